#!/usr/bin/env bash
# A shaped network path for honest edge-client measurements (docs/netns.md).
#
# The server runs inside network namespace NAME behind a veth pair; the client stays in the root
# namespace and talks to the namespace's address. tc shapes the namespace-side veth egress, i.e.
# the server->client direction (downloads): a token bucket (tbf) at the trace's rate, preceded by
# netem delay RTT/2 where the kernel has netem; the host-side veth egress (requests, ACKs) gets
# the other RTT/2.
#
#   netns-link.sh up NAME [HOST_IP NS_IP]   create the namespace, the veth pair, addresses (/30)
#   netns-link.sh rate NAME MBPS [RTT_MS]   set/replace the shaping (repeatable while traffic flows)
#   netns-link.sh exec NAME CMD...          run CMD inside the namespace
#   netns-link.sh down NAME                 delete everything (idempotent)
#   netns-link.sh check                     exit 0 if this machine permits it, else say why, exit 1
#   netns-link.sh show NAME                 print the qdiscs of both veth ends (with statistics)
#
# NAME must start with "sparkv-" (so that `down` can never remove someone else's namespace).
# Interfaces: host side vh-<short>, namespace side vn-<short>, <short> = NAME without the prefix
# (or an 8-hex-digit hash of NAME when that is longer than 12 characters or unusual).
# Needs root, iproute2 (ip, tc) and a kernel with network namespaces, veth and sch_tbf;
# sch_netem is optional (without it RTT_MS cannot be emulated: `rate` warns and ignores it).
#
# Tuning (environment, integers; docs/netns.md says why these defaults): SPARKV_TBF_BURST_MS (2),
# SPARKV_TBF_QUEUE_MS (50), SPARKV_TBF_MIN_QUEUE_FRAMES (16), SPARKV_GSO_MAX_SEGS (8, read by `up`).
set -euo pipefail

PREFIX="sparkv-"
BURST_MS="${SPARKV_TBF_BURST_MS:-2}"
QUEUE_MS="${SPARKV_TBF_QUEUE_MS:-50}"
GSO_MAX_SEGS="${SPARKV_GSO_MAX_SEGS:-8}"
MIN_BURST=3100      # bytes: two full Ethernet frames (1514 B each), the least tbf may hold
FRAME_BYTES=1514    # a full-size Ethernet frame on the veth (MTU 1500)
PAYLOAD_BYTES=1448  # the TCP payload it carries (IPv4 20 + TCP 20 + timestamps 12 bytes of headers)
MIN_QUEUE_FRAMES="${SPARKV_TBF_MIN_QUEUE_FRAMES:-16}"  # the queue holds at least this many frames
NETEM_LIMIT=100000  # packets netem may hold while they wait out their delay (bounded by TCP windows)

die() { echo "netns-link: $*" >&2; exit 1; }

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '/^set -euo/d' -e 's/^# \{0,1\}//' >&2
    exit 2
}

check_name() {
    local name="$1"
    [[ "$name" == "$PREFIX"* ]] || die "namespace name '$name' must start with '$PREFIX'"
    [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || die "namespace name '$name' has odd characters"
    (( ${#name} <= 64 )) || die "namespace name '$name' is too long"
}

short_of() {
    local rest="${1#"$PREFIX"}"
    if [[ ${#rest} -ge 1 && ${#rest} -le 12 && "$rest" =~ ^[A-Za-z0-9_-]+$ ]]; then
        echo "$rest"
    else
        printf '%08x\n' "$(printf '%s' "$1" | cksum | cut -d' ' -f1)"
    fi
}

# Default /30 addresses from the name: 10.213.X.Y, X.Y from a checksum (16384 possible subnets).
default_ips() {
    local sum idx
    sum=$(printf '%s' "$1" | cksum | cut -d' ' -f1)
    idx=$(( sum % 16384 ))
    local net="10.213.$(( idx / 64 ))" base=$(( (idx % 64) * 4 ))
    echo "$net.$(( base + 1 )) $net.$(( base + 2 ))"
}

ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qxF -- "$1"; }

# Root qdisc kind of a device ("netem", "tbf", "noqueue", ...); $1 = "" or "-n NAME".
root_kind() {
    # shellcheck disable=SC2086
    tc $1 qdisc show dev "$2" root 2>/dev/null | awk 'NR==1 {print $2}'
}

cmd_up() {
    local name="$1" host_ip="${2:-}" ns_ip="${3:-}"
    check_name "$name"
    if [[ -z "$host_ip" || -z "$ns_ip" ]]; then
        read -r host_ip ns_ip <<<"$(default_ips "$name")"
    fi
    local short vh vn
    short=$(short_of "$name"); vh="vh-$short"; vn="vn-$short"
    ns_exists "$name" && die "namespace $name exists already (run: $0 down $name)"
    ip link show "$vh" >/dev/null 2>&1 && die "interface $vh exists already (run: $0 down $name)"
    trap 'cmd_down "$name" >/dev/null 2>&1 || true' ERR
    ip netns add "$name"
    ip link add "$vh" type veth peer name "$vn" netns "$name"
    ip addr add "$host_ip/30" dev "$vh"
    ip -n "$name" addr add "$ns_ip/30" dev "$vn"
    ip link set "$vh" up
    # Cap the size of the GSO super-packets the server's TCP hands the shaper (tbf splits them,
    # but a 64 KB one arriving at once overflows a short queue: bursts of drops at low rates).
    ip -n "$name" link set dev "$vn" gso_max_segs "$GSO_MAX_SEGS" 2>/dev/null ||
        echo "netns-link: warning: could not cap GSO on $vn (old iproute2?)" >&2
    ip -n "$name" link set "$vn" up
    ip -n "$name" link set lo up
    # Probe netem once on the host side (delay 0): its presence marks "RTT can be emulated".
    tc qdisc replace dev "$vh" root handle 1: netem delay 0ms limit "$NETEM_LIMIT" 2>/dev/null || true
    trap - ERR
    echo "$name $vh $host_ip $vn $ns_ip"
}

cmd_rate() {
    local name="$1" mbps="$2" rtt="${3:-}"
    check_name "$name"
    ns_exists "$name" || die "namespace $name is not up"
    [[ "$mbps" =~ ^[0-9]+([.][0-9]*)?$ ]] || die "MBPS must be a number >= 0, got '$mbps'"
    [[ -z "$rtt" || "$rtt" =~ ^[0-9]+([.][0-9]*)?$ ]] || die "RTT_MS must be a number >= 0, got '$rtt'"
    local short vh vn
    short=$(short_of "$name"); vh="vh-$short"; vn="vn-$short"

    # MBPS is TCP goodput: tbf counts whole Ethernet frames, so the shaped rate is scaled by
    # frame/payload (1514/1448 for MTU 1500 with TCP timestamps). Integer arithmetic in kbit/s
    # (1 kbit = 1000 bit) and bytes. A rate of 0 (an outage in a trace) becomes 8 kbit/s: tbf
    # cannot stop a link, and 1 KB/s is an outage for a KV cache.
    local kbit rate_Bps burst limit queue_ms="$QUEUE_MS" rtt_ms_int=0
    kbit=$(awk -v m="$mbps" -v f="$FRAME_BYTES" -v p="$PAYLOAD_BYTES" \
        'BEGIN { k = int(m * 1000 * f / p + 0.5); if (k < 8) k = 8; print k }')
    rate_Bps=$(( kbit * 125 ))
    burst=$(( rate_Bps * BURST_MS / 1000 ))
    (( burst >= MIN_BURST )) || burst=$MIN_BURST
    # The queue holds QUEUE_MS of data, or one bandwidth-delay product when the RTT is longer
    # (what a loss-based TCP needs to keep the link busy).
    [[ -n "$rtt" ]] && rtt_ms_int=$(awk -v r="$rtt" 'BEGIN { print int(r + 0.5) }')
    (( rtt_ms_int > queue_ms )) && queue_ms=$rtt_ms_int
    limit=$(( burst + rate_Bps * queue_ms / 1000 ))
    (( limit >= burst + MIN_QUEUE_FRAMES * FRAME_BYTES )) ||
        limit=$(( burst + MIN_QUEUE_FRAMES * FRAME_BYTES ))
    local tbf="tbf rate ${kbit}kbit burst $burst limit $limit"

    if [[ "$(root_kind "" "$vh")" == netem ]]; then
        local half=""
        if [[ -n "$rtt" ]]; then
            half=$(awk -v r="$rtt" 'BEGIN { printf "%dus", int(r * 500 + 0.5) }')
            tc qdisc replace dev "$vh" root handle 1: netem delay "$half" limit "$NETEM_LIMIT"
        fi
        if [[ "$(root_kind "-n $name" "$vn")" != netem ]]; then
            tc -n "$name" qdisc replace dev "$vn" root handle 1: netem delay "${half:-0us}" \
                limit "$NETEM_LIMIT"
            tc -n "$name" qdisc replace dev "$vn" parent 1:1 handle 10: $tbf
        elif [[ -n "$half" ]]; then
            tc -n "$name" -batch - <<EOF
qdisc change dev $vn root handle 1: netem delay $half limit $NETEM_LIMIT
qdisc replace dev $vn parent 1:1 handle 10: $tbf
EOF
        else
            tc -n "$name" qdisc replace dev "$vn" parent 1:1 handle 10: $tbf
        fi
    else
        if [[ -n "$rtt" ]] && awk -v r="$rtt" 'BEGIN { exit !(r > 0) }'; then
            echo "netns-link: warning: this kernel has no sch_netem; RTT ${rtt} ms not emulated" >&2
        fi
        tc -n "$name" qdisc replace dev "$vn" root handle 1: $tbf
    fi
}

cmd_exec() {
    local name="$1"; shift
    check_name "$name"
    (( $# > 0 )) || die "exec needs a command"
    exec ip netns exec "$name" "$@"
}

cmd_down() {
    local name="$1"
    check_name "$name"
    local short vh vn
    short=$(short_of "$name"); vh="vh-$short"; vn="vn-$short"
    if ns_exists "$name"; then
        # Processes left in the namespace would keep it (and the veth) alive: end them, by id.
        local pids
        pids=$(ip netns pids "$name" 2>/dev/null || true)
        if [[ -n "$pids" ]]; then
            # shellcheck disable=SC2086
            kill -TERM $pids 2>/dev/null || true
            for _ in 1 2 3 4 5 6 7 8 9 10; do
                pids=$(ip netns pids "$name" 2>/dev/null || true)
                [[ -z "$pids" ]] && break
                sleep 0.1
            done
            # shellcheck disable=SC2086
            [[ -n "$pids" ]] && kill -KILL $pids 2>/dev/null || true
        fi
        ip -n "$name" link del "$vn" 2>/dev/null || true
        ip netns del "$name" 2>/dev/null || true
    fi
    ip link del "$vh" 2>/dev/null || true
    ns_exists "$name" && die "could not delete namespace $name"
    return 0
}

cmd_show() {
    local name="$1"
    check_name "$name"
    local short; short=$(short_of "$name")
    echo "# host side vh-$short"; tc -s qdisc show dev "vh-$short"
    echo "# namespace side vn-$short"; tc -n "$name" -s qdisc show dev "vn-$short"
}

cmd_check() {
    [[ "$(id -u)" == 0 ]] || { echo "not root (uid $(id -u)): network namespaces need root"; exit 1; }
    command -v ip >/dev/null || { echo "ip (iproute2) is not installed"; exit 1; }
    command -v tc >/dev/null || { echo "tc (iproute2) is not installed"; exit 1; }
    local ns="${PREFIX}check-$$" out
    # The probe lives entirely inside a throwaway namespace: a veth pair with both ends in it.
    if ! out=$(ip netns add "$ns" 2>&1); then
        echo "cannot create a network namespace: $out"; exit 1
    fi
    # shellcheck disable=SC2064
    trap "ip netns del '$ns' 2>/dev/null || true" EXIT
    if ! out=$(ip -n "$ns" link add vc0 type veth peer name vc1 2>&1); then
        echo "cannot create a veth pair: $out"; exit 1
    fi
    if ! out=$(tc -n "$ns" qdisc add dev vc0 root handle 1: \
            tbf rate 10mbit burst 3100 limit 30000 2>&1); then
        echo "cannot attach a tbf qdisc (sch_tbf): $out"; exit 1
    fi
    if tc -n "$ns" qdisc add dev vc1 root handle 1: netem delay 1ms >/dev/null 2>&1; then
        echo "ok (netem: yes)"
    else
        echo "ok (netem: no, RTT cannot be emulated)"
    fi
}

(( $# >= 1 )) || usage
cmd="$1"; shift
case "$cmd" in
    up)    (( $# == 1 || $# == 3 )) || usage; cmd_up "$@" ;;
    rate)  (( $# == 2 || $# == 3 )) || usage; cmd_rate "$@" ;;
    exec)  (( $# >= 2 )) || usage; cmd_exec "$@" ;;
    down)  (( $# == 1 )) || usage; cmd_down "$@" ;;
    show)  (( $# == 1 )) || usage; cmd_show "$@" ;;
    check) (( $# == 0 )) || usage; cmd_check ;;
    -h|--help|help) usage ;;
    *) usage ;;
esac
