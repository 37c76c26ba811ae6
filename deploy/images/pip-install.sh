#!/bin/sh
# pip-install LOCK [PIP OPTIONS]: install exactly the files LOCK names, inside an image build.
#
# Hash-checking mode (every line of LOCK carries --hash), wheels only, no dependency resolution
# (the lock is complete: `pip check` runs after). Pip reads only what this build passes in: the
# BuildKit secret `pipconf` (a pip.conf: index, proxy, local wheel folder) and `pipca` (a CA
# bundle), both mounted under /run/secrets for one RUN and never in a layer; without them, no
# configuration file at all and PyPI.
set -eu
lock=$1
shift
if [ -s /run/secrets/pipconf ]; then
    PIP_CONFIG_FILE=/run/secrets/pipconf
else
    PIP_CONFIG_FILE=/dev/null  # pip's documented "no configuration files"
fi
export PIP_CONFIG_FILE
if [ -s /run/secrets/pipca ]; then
    export PIP_CERT=/run/secrets/pipca
fi
exec pip install --require-hashes --no-deps --only-binary :all: -r "$lock" "$@"
