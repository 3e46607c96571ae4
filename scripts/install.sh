#!/usr/bin/env bash
# Install the orin-agent systemd unit, its default config and a bearer token. Idempotent: a second
# run changes nothing (an existing config or token is kept). It never reports a token the service does
# not use: with an existing config it reads what that config says about the token and acts on that.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: scripts/install.sh [--dry-run] [--add-token] [--help]
  Installs /etc/systemd/system/orin-agent.service (ExecStart = the orin-agent command on PATH, or
  $ORIN_AGENT_BIN), /etc/orin-agent/agent.toml (kept if present) and /etc/orin-agent/token (a random
  bearer token, mode 0600, kept if present; the installed config points server.token_file at it).
  An existing agent.toml decides the token: its server.token_file (the token is made there only if it
  is /etc/orin-agent/token), its inline server.token, or none (then no token is made: the service
  answers without one) unless --add-token.
  --add-token  an existing agent.toml without a token gets server.token_file = /etc/orin-agent/token
  --dry-run    show what would be done, change nothing
  --help       this text
  DESTDIR=/tmp/stage scripts/install.sh   stages into a tree (packaging, tests)
USAGE
}

dry=0
add_token=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry=1 ;;
        --add-token) add_token=1 ;;
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

# What an existing config says about the token, from its [server] table: "file PATH", "inline" or
# "none" ("unclear LINE" for a token line this reader cannot take: a multi-line string, a table, ...).
config_token() {
    local line section="" key value
    while IFS= read -r line || [[ -n "$line" ]]; do
        line="${line#"${line%%[![:space:]]*}"}"
        [[ -z "$line" || "$line" == \#* ]] && continue
        if [[ "$line" =~ ^\[([^]]*)\] ]]; then
            section="${BASH_REMATCH[1]//[[:space:]]/}"
            continue
        fi
        [[ "$section" == server ]] || continue
        [[ "$line" =~ ^(token|token_file)[[:space:]]*= ]] || continue
        key="${BASH_REMATCH[1]}"
        if [[ "$line" =~ ^[a-z_]+[[:space:]]*=[[:space:]]*\"([^\"\\]*)\"[[:space:]]*(#.*)?$ ||
              "$line" =~ ^[a-z_]+[[:space:]]*=[[:space:]]*\'([^\']*)\'[[:space:]]*(#.*)?$ ]]; then
            value="${BASH_REMATCH[1]}"
        else
            printf 'unclear %s\n' "$line"
            return
        fi
        [[ -z "$value" ]] && continue          # "" = unset
        if [[ "$key" == token_file ]]; then printf 'file %s\n' "$value"; else printf 'inline\n'; fi
        return
    done
    printf 'none\n'
}

# The existing config with server.token_file added: the shipped commented line replaced, else the line
# added under [server], else a [server] table appended.
add_token_file() {
    local line done=0 in_server=0
    while IFS= read -r line || [[ -n "$line" ]]; do
        if ((!done)) && [[ "$line" =~ ^[[:space:]]*\[ ]]; then
            ((in_server)) && { printf 'token_file = "%s"\n' "$token_path"; done=1; }
            [[ "$line" =~ ^[[:space:]]*\[server\] ]] && in_server=1 || in_server=0
        fi
        if ((!done && in_server)) && [[ "$line" == '# token_file = '* ]]; then
            printf 'token_file = "%s"\n' "$token_path"
            done=1
            continue
        fi
        printf '%s\n' "$line"
    done
    ((in_server && !done)) && { printf 'token_file = "%s"\n' "$token_path"; done=1; }
    ((done)) || printf '\n[server]\ntoken_file = "%s"\n' "$token_path"
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

# What to do about the config and the token: "new" (the shipped config, our token), "ours" (the
# config reads $token_path: make it if missing), "add" (--add-token: point the config at it), or leave.
conf="$conf_dir/agent.toml"
plan=new
if [[ -e "$conf" ]]; then
    read -r state token_where < <(config_token < "$conf")
    case "$state" in
        file) if [[ "$token_where" == "$token_path" ]]; then plan=ours; else plan=theirs; fi ;;
        inline) plan=inline ;;
        none) if ((add_token)); then plan=add; else plan=tokenless; fi ;;
        *) echo "error: cannot tell what $conf says about the token (server: $token_where); check it by" \
                "hand: server.token_file = \"$token_path\" or none" >&2
           exit 2 ;;
    esac
fi
make_token=0
[[ "$plan" == new || "$plan" == ours || "$plan" == add ]] && [[ ! -e "$conf_dir/token" ]] && make_token=1

if ((dry)); then
    echo "+ install -d -m 0755 $unit_dir"
    echo "+ install -d -m 0750 $conf_dir"
    echo "+ write $unit_dir/orin-agent.service (ExecStart=$exec_bin serve ...)"
    [[ "$plan" == new ]] && echo "+ write $conf (token_file = $token_path)"
    [[ "$plan" == add ]] && echo "+ add token_file = \"$token_path\" to [server] in $conf"
    ((make_token)) && echo "+ write $conf_dir/token (random, mode 0600)"
    exit 0
fi

install -d -m 0755 "$unit_dir"
install -d -m 0750 "$conf_dir"
render_unit | put 0644 "$unit_dir/orin-agent.service"
case "$plan" in
    new) render_config | put 0640 "$conf" ;;
    add) mode="$(stat -c %a "$conf")"
         add_token_file < "$conf" | put "$mode" "$conf"
         echo "updated the existing $conf: server.token_file = \"$token_path\" (clients must now send the token)" ;;
    *) echo "keeping the existing $conf (the new default is $here/systemd/agent.toml)" ;;
esac
case "$plan" in
    new|ours|add)
        if ((make_token)); then
            (umask 077; head -c 32 /dev/urandom | base64 | tr -d '\n=' | put 0600 "$conf_dir/token")
            echo "a bearer token is in $conf_dir/token (send it as 'Authorization: Bearer <token>')"
        else
            echo "keeping the existing bearer token $conf_dir/token ($conf reads it)"
        fi ;;
    theirs)
        echo "$conf reads its bearer token from $token_where: no token made here"
        [[ -e "$dest$token_where" ]] || echo "warning: $token_where does not exist: the service will not start" \
                                              "until it holds the token (mode 0600)" >&2 ;;
    inline)
        echo "$conf holds an inline server.token: no token file made (prefer server.token_file)" ;;
    tokenless)
        echo "$conf sets no token: the service answers without one, so no token was made. To require one:" \
             "scripts/install.sh --add-token (adds server.token_file = \"$token_path\" to it)"
        [[ -e "$conf_dir/token" ]] && echo "note: $conf_dir/token exists but $conf does not use it" ;;
esac
if [[ -z "$dest" ]] && command -v systemctl >/dev/null && [[ -d /run/systemd/system ]]; then
    systemctl daemon-reload
    echo "installed. start it with: sudo systemctl enable --now orin-agent"
else
    echo "installed into ${dest:-/} (no running systemd here: not reloaded)"
fi
