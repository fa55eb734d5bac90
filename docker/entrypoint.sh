#!/bin/sh
# Runs `tandem serve` in the images (and wherever a server is started as the containers
# start it, e.g. the multi-host test). Every setting comes from the environment:
# TANDEM_<OPTION> is the default of --<option> (TANDEM_MODE, TANDEM_PREFILL_ENDPOINTS,
# TANDEM_GRPC_PORT, ...; `tandem serve` reads them itself), and arguments given here win.
# Only what a container needs differently is defaulted here.
set -eu
: "${TANDEM_HOST:=0.0.0.0}"   # reachable from outside the container (tandem serve: 127.0.0.1)
export TANDEM_HOST
# the run dir (rendered model repository, backend) stays tandem serve's default: a fresh
# temporary directory under ${TMPDIR:-/tmp}, removed when it stops
exec tandem serve "$@"
