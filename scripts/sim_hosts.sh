#!/usr/bin/env bash
# Simulated hosts on one Linux machine: N network namespaces ("hosts"), each with its own
# address on a private bridge, so that torchrun, gloo and meshforge see several machines.
#
#   sudo scripts/sim_hosts.sh up   NAME N [NETEM...]   # hosts NAME-h0..h{N-1}, addresses 10.77.0.1..N
#   sudo scripts/sim_hosts.sh exec NAME I CMD...       # run CMD on host I (ip netns exec NAME-hI)
#   sudo scripts/sim_hosts.sh kill NAME I              # SIGKILL every process on host I (a host dies)
#   sudo scripts/sim_hosts.sh down NAME                # remove the hosts and the switch
#
# NETEM (optional) is a tc netem spec applied to every host's outgoing traffic, e.g.
# "rate 100mbit delay 20ms" (one way; a round trip then takes 40 ms). Each host's interface
# is eth0 (GLOO_SOCKET_IFNAME=eth0). The bridge lives in a namespace of its own (NAME-sw), so
# nothing is added to the machine's own network and traffic never leaves these addresses.
# The subnet defaults to 10.77.0.0/24 (SIM_HOSTS_NET=10.77.0 to change it). Needs root
# (CAP_NET_ADMIN) and iproute2. NAME: up to 8 letters/digits, unique per run.
set -euo pipefail

NET=${SIM_HOSTS_NET:-10.77.0}

usage() { sed -n 2,16p "$0" >&2; exit 2; }

check_name() {
    [[ "$1" =~ ^[A-Za-z0-9]{1,8}$ ]] || { echo "sim_hosts: NAME '$1' must be 1-8 letters or digits" >&2; exit 2; }
}

down() {
    local name=$1 ns
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^${name}-(h[0-9]+|sw)$" || true); do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true  # its veth ends go with it
    done
}

shape() {  # netem where the kernel has it; else the rate alone through tbf, saying so
    local ns=$1 spec=$2 rate
    # shellcheck disable=SC2086
    ip netns exec "$ns" tc qdisc add dev eth0 root netem $spec 2>/dev/null && return 0
    rate=$(sed -nE 's/.*rate ([0-9.]+[a-zA-Z]*).*/\1/p' <<<"$spec")
    [[ -n "$rate" ]] || { echo "sim_hosts: tc netem is not available here and '$spec' names no rate" >&2; return 1; }
    echo "sim_hosts: warning: tc netem is not available (kernel module sch_netem); $ns gets rate $rate" \
        "through tbf and no added delay" >&2
    ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 64kb latency 1s
}

up() {
    local name=$1 n=$2; shift 2
    local netem="$*" i
    [[ "$n" =~ ^[0-9]+$ && "$n" -ge 1 && "$n" -le 200 ]] || { echo "sim_hosts: N must be 1..200" >&2; exit 2; }
    trap 'down "$name"' ERR  # a half-made set of hosts is removed, never left behind
    ip netns add "$name-sw"
    ip -n "$name-sw" link add br0 type bridge
    ip -n "$name-sw" link set br0 up
    ip -n "$name-sw" link set lo up
    for ((i = 0; i < n; i++)); do
        ip netns add "$name-h$i"
        ip link add "${name}v$i" type veth peer name "${name}s$i"  # made here, both ends moved away at once
        ip link set "${name}v$i" netns "$name-h$i" name eth0
        ip link set "${name}s$i" netns "$name-sw" name "p$i"
        ip -n "$name-sw" link set "p$i" master br0 up
        ip -n "$name-h$i" addr add "$NET.$((i + 1))/24" dev eth0
        ip -n "$name-h$i" link set eth0 up
        ip -n "$name-h$i" link set lo up
        [[ -z "$netem" ]] || shape "$name-h$i" "$netem"
        echo "$name-h$i $NET.$((i + 1))"
    done
    trap - ERR
}

[[ $# -ge 2 ]] || usage
cmd=$1 name=$2
check_name "$name"
case "$cmd" in
    up) [[ $# -ge 3 ]] || usage; up "$name" "$3" "${@:4}" ;;
    down) down "$name" ;;
    exec) [[ $# -ge 4 ]] || usage; exec ip netns exec "$name-h$3" "${@:4}" ;;
    kill) [[ $# -eq 3 ]] || usage; ip netns pids "$name-h$3" | xargs -r kill -9 ;;
    *) usage ;;
esac
