#!/usr/bin/env bash
# Install the orin-agent systemd unit, its default config and a bearer token. Idempotent: a second
# run changes nothing (an existing config or token is kept).
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: scripts/install.sh [--dry-run] [--help]
  Installs /etc/systemd/system/orin-agent.service (ExecStart = the orin-agent command on PATH, or
  $ORIN_AGENT_BIN), /etc/orin-agent/agent.toml (kept if present) and /etc/orin-agent/token (a random
  bearer token, mode 0600, kept if present; the installed config points server.token_file at it).
  --dry-run   show what would be done, change nothing
  --help      this text
  DESTDIR=/tmp/stage scripts/install.sh   stages into a tree (packaging, tests)
USAGE
}

dry=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "error: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
    esac
done

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="${DESTDIR:-}"
bin="${ORIN_AGENT_BIN:-$(command -v orin-agent || true)}"
if [[ -z "$bin" ]]; then
    echo "error: the orin-agent command is not on PATH; run 'pip install .' in $here first" >&2
    exit 2
fi
if [[ "$bin" != /* ]]; then
    echo "error: the orin-agent command must be an absolute path, got '$bin'" >&2
    exit 2
fi
# systemd's ExecStart= takes a path in double quotes, with % doubled; these cannot be written safely.
if [[ "$bin" == *[[:cntrl:]\"\\\$\`\'%]* ]]; then
    echo "error: the path '$bin' has a character the unit file cannot hold (quote, backslash, \$, backtick, %, control)" >&2
    exit 2
fi
if [[ ! -x "$bin" || -d "$bin" ]]; then
    echo "error: '$bin' is not an executable file" >&2
    exit 2
fi
exec_bin="$bin"
[[ "$bin" == *" "* ]] && exec_bin="\"$bin\""

unit_dir="$dest/etc/systemd/system"
conf_dir="$dest/etc/orin-agent"
token_path="/etc/orin-agent/token"

# The unit from its template: @BIN@ replaced by plain string splitting (no sed: a path with & or |
# must come through as it is), written to a temp file beside the target, then moved into place.
render_unit() {
    local line
    while IFS= read -r line || [[ -n "$line" ]]; do
        while [[ "$line" == *@BIN@* ]]; do
            line="${line%%@BIN@*}${exec_bin}${line#*@BIN@}"
        done
        printf '%s\n' "$line"
    done < "$here/systemd/orin-agent.service"
}

# The installed config: the shipped one with server.token_file pointing at the generated token.
render_config() {
    local line
    while IFS= read -r line || [[ -n "$line" ]]; do
        case "$line" in
            'token = ""'*) printf 'token = ""                 # the token is in token_file\n' ;;
            '# token_file = '*) printf 'token_file = "%s"\n' "$token_path" ;;
            *) printf '%s\n' "$line" ;;
        esac
    done < "$here/systemd/agent.toml"
}

put() {  # put MODE TARGET: stdin to a temp file beside TARGET, then rename (never a half-written file)
    local mode="$1" target="$2" tmp
    tmp="$(mktemp "$target.XXXXXX")"
    trap 'rm -f "$tmp"' EXIT
    cat > "$tmp"
    chmod "$mode" "$tmp"
    mv -f "$tmp" "$target"
    trap - EXIT
}

if ((dry)); then
    echo "+ install -d -m 0755 $unit_dir"
    echo "+ install -d -m 0750 $conf_dir"
    echo "+ write $unit_dir/orin-agent.service (ExecStart=$exec_bin serve ...)"
    [[ -e "$conf_dir/agent.toml" ]] || echo "+ write $conf_dir/agent.toml (token_file = $token_path)"
    [[ -e "$conf_dir/token" ]] || echo "+ write $conf_dir/token (random, mode 0600)"
    exit 0
fi

install -d -m 0755 "$unit_dir"
install -d -m 0750 "$conf_dir"
render_unit | put 0644 "$unit_dir/orin-agent.service"
if [[ -e "$conf_dir/agent.toml" ]]; then
    echo "keeping the existing $conf_dir/agent.toml (the new default is $here/systemd/agent.toml)"
else
    render_config | put 0640 "$conf_dir/agent.toml"
fi
if [[ -e "$conf_dir/token" ]]; then
    echo "keeping the existing bearer token $conf_dir/token"
else
    (umask 077; head -c 32 /dev/urandom | base64 | tr -d '\n=' | put 0600 "$conf_dir/token")
    echo "a bearer token is in $conf_dir/token (send it as 'Authorization: Bearer <token>')"
fi
if [[ -z "$dest" ]] && command -v systemctl >/dev/null && [[ -d /run/systemd/system ]]; then
    systemctl daemon-reload
    echo "installed. start it with: sudo systemctl enable --now orin-agent"
else
    echo "installed into ${dest:-/} (no running systemd here: not reloaded)"
fi
