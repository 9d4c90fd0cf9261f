# Two commands do all set-up on a fresh machine:
#   make serve   start the whole local system on the default model
#   make test    install what the tests need and run them
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/local.yaml
PYTEST_ARGS ?= --durations=30  # the slowest tests, at the end of every run (CI logs)

export HF_HUB_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export UCX_WARN_UNUSED_ENV_VARS := n

.PHONY: venv model tools serve test test-fast lint proto bench clean

venv:
	@bash scripts/bootstrap.sh

model: venv
	@$(PY) -m pdd.cli model prepare

serve: model
	$(PY) -m pdd.cli serve --config $(CONFIG)

test: model tools
	$(PY) -m pytest $(PYTEST_ARGS)

# Debian's promtool (checks the Prometheus config and rules in tests/deploy); optional.
tools: venv
	@bash tests/deploy/install_promtool.sh $(VENV) >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && bash tests/deploy/install_promtool.sh $(VENV); } || \
	  echo "warning: promtool unavailable; its tests will skip"

test-fast: venv
	$(PY) -m pytest -m "not slow and not lab" $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check pdd tests
	$(VENV)/bin/ruff format --check pdd tests

proto: venv
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. pdd/proto/worker.proto

clean:
	rm -rf $(VENV) .pytest_cache
