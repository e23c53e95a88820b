#!/usr/bin/env bash
# What the test suite drives from the system: iproute2 and iptables (bench.reach builds a
# real NAT in network namespaces), Chromium and its driver (the page in a real browser).
# Installs the missing ones with apt-get when run as root; otherwise says in one line what
# is missing, and the tests that need it skip with that reason. Never fails the build.
set -u
missing=()
command -v ip >/dev/null || missing+=(iproute2)
command -v iptables >/dev/null || missing+=(iptables)
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
[ "${#missing[@]}" -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing system packages the tests use: ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
    || echo "could not install ${missing[*]}: the tests that need them will skip"
else
  echo "missing ${missing[*]} (install them as root with apt-get): the tests that need them will skip"
fi
exit 0
