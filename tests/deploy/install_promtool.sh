#!/usr/bin/env bash
# Puts Debian's promtool (package `prometheus`, ~19 MB download) into the venv, so the
# deploy tests can run `promtool check config|rules` and `promtool test rules`. It unpacks
# the package instead of installing it: nothing is configured and no Prometheus server
# starts. Needs the Debian archive (apt-get update done); not root. Idempotent.
#   bash tests/deploy/install_promtool.sh [VENV]
set -euo pipefail
VENV=${1:-${VENV:-.venv}}
[[ -x "$VENV/bin/promtool" ]] && exit 0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -q prometheus >/dev/null)
dpkg -x "$work"/prometheus_*.deb "$work/root"
install -m 0755 "$work/root/usr/bin/promtool" "$VENV/bin/promtool"
"$VENV/bin/promtool" --version | head -1
