#!/usr/bin/env bash
# System packages some tests need, installed where this runs as root with apt-get (CI does); elsewhere the
# tests that need them skip, saying why. openssh-server + iproute2: the multi-host pool tests
# (tests/pool/test_multi_host.py: network namespaces with sshd, reached by mpirun over ssh).
PACKAGES="openssh-server openssh-client iproute2"
if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q $PACKAGES > /dev/null 2>&1 \
        || { apt-get update -q > /dev/null 2>&1 && apt-get install -y -q $PACKAGES > /dev/null 2>&1; } \
        || echo "install_system_packages: could not install $PACKAGES; the multi-host tests will skip" >&2
fi
exit 0
