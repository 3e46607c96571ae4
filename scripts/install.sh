#!/usr/bin/env bash
# Install the orin-agent systemd unit and its default config.
#   sudo scripts/install.sh            # install (keeps an existing /etc/orin-agent/agent.toml)
#   scripts/install.sh --dry-run       # show what would be done
#   DESTDIR=/tmp/stage scripts/install.sh   # stage into a tree (packaging, tests)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dry=0
[[ "${1:-}" == "--dry-run" ]] && dry=1
dest="${DESTDIR:-}"
bin="${ORIN_AGENT_BIN:-$(command -v orin-agent || true)}"
if [[ -z "$bin" ]]; then
    echo "error: the orin-agent command is not on PATH; run 'pip install .' in $here first" >&2
    exit 2
fi

run() { if ((dry)); then echo "+ $*"; else "$@"; fi; }

unit_dir="$dest/etc/systemd/system"
conf_dir="$dest/etc/orin-agent"
run install -d -m 0755 "$unit_dir"
run install -d -m 0750 "$conf_dir"
if ((dry)); then
    echo "+ sed s|@BIN@|$bin| $here/systemd/orin-agent.service > $unit_dir/orin-agent.service"
else
    sed "s|@BIN@|$bin|g" "$here/systemd/orin-agent.service" > "$unit_dir/orin-agent.service"
    chmod 0644 "$unit_dir/orin-agent.service"
fi
if [[ -e "$conf_dir/agent.toml" ]]; then
    echo "keeping the existing $conf_dir/agent.toml (the new default is $here/systemd/agent.toml)"
else
    run install -m 0640 "$here/systemd/agent.toml" "$conf_dir/agent.toml"
fi
if [[ -z "$dest" ]] && command -v systemctl >/dev/null && [[ -d /run/systemd/system ]]; then
    run systemctl daemon-reload
    echo "installed. start it with: sudo systemctl enable --now orin-agent"
    echo "a bearer token: head -c 32 /dev/urandom | base64 > /etc/orin-agent/token; chmod 600 it; set server.token_file"
else
    echo "installed into ${dest:-/} (no running systemd here: not reloaded)"
fi
