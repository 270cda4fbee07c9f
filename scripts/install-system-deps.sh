#!/usr/bin/env bash
# What the tests need beyond Python: the real Prometheus (with promtool) and Alertmanager
# (with amtool) for the alerting tests, Chromium for the dashboard's browser test. Installs
# the Debian packages that are missing (as root, or through sudo without a password);
# elsewhere it names them and stops, so that `make test` fails here and not half-way.
# Without systemd the packages start no daemons; the tests start their own on 127.0.0.1.
set -euo pipefail

need=()
command -v promtool >/dev/null || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null || need+=(prometheus-alertmanager)
command -v chromium >/dev/null || need+=(chromium)
[ ${#need[@]} -eq 0 ] && exit 0

as_root=()
if [ "$(id -u)" -ne 0 ]; then
    if sudo -n true 2>/dev/null; then
        as_root=(sudo -n)
    else
        as_root=(false)
    fi
fi
if ! command -v apt-get >/dev/null || [ "${as_root[0]:-}" = false ]; then
    echo "error: the tests need ${need[*]} (Debian package names); install them, as root" \
        "on Debian or Ubuntu: apt-get install ${need[*]}" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}"
