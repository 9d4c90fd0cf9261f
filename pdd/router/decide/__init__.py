"""Pure decisions over a snapshot, no I/O: ``view`` (FleetView, RouteRequest, Decision),
``routing.choose`` and ``policy`` (the pdd and pd-baseline branches, scores), ``recovery``
(what to do after a worker loss). Start at ``routing``."""
