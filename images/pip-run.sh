#!/bin/sh
# Runs a pip command inside an image build with the build's pip secrets, when given:
#   pip-conf  a pip config file (the building machine's own)
#   pip-cert  a CA bundle (needed where TLS to the index passes a proxy)
# BuildKit mounts them at /run/secrets/<id> for one RUN only; they never reach a layer.
# Without them (a user's plain build) pip runs with its defaults. The Dockerfile
# bind-mounts this file from the build context, so it is in no image either.
#   sh pip-run.sh /opt/venv/bin/pip install ...
set -eu
if [ -f /run/secrets/pip-conf ]; then
    export PIP_CONFIG_FILE=/run/secrets/pip-conf
fi
# The environment outranks the config file, whose `cert` names a path on the host.
if [ -f /run/secrets/pip-cert ]; then
    export PIP_CERT=/run/secrets/pip-cert
fi
# The build's cache mount, whatever HOME the stage sets (the runtime stages set the
# non-root user's, which must not end up holding pip's cache).
export PIP_CACHE_DIR=/root/.cache/pip
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1
exec "$@"
