#!/usr/bin/env bash
# The wheels benchmarks/gpu.py needs on the GPU machine, which has no package index (docs/benchmarks.md,
# "GPU acceptance"). The list, with hashes and sizes, is scripts/gpu_wheels.txt.
#
#   scripts/gpu_wheels.sh --dry-run        list the wheels, their sizes and the loads they travel in (no network)
#   scripts/gpu_wheels.sh                  here: download them (pip checks every hash) into .gpu/wheels and pack
#                                          them into .gpu/load-1, .gpu/load-2, ... of at most LOAD_MIB each
#   scripts/gpu_wheels.sh --install DIR    there: join the parts copied into DIR, check them, install the wheels
#                                          and this project into $GPU_SITE (default /tmp/site) for PYTHONPATH
#
# One transfer to the GPU machine carries at most 64 MiB with the work tree, and the default teacher's wheel
# alone is 88.6 MiB: so the files travel as loads, one per call of the device tool, each copied to the same
# folder outside the work tree (what a call leaves there survives while the machine stays warm), and the
# last call installs and runs. A file larger than a load's room is cut into parts (NAME.part-0, -1, ...).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LIST="$ROOT/scripts/gpu_wheels.txt"
GPU="$ROOT/.gpu"  # git-ignored
LOAD_MIB="${LOAD_MIB:-58}"  # per load; the rest of the 64 MiB is the work tree's
PYTHON_VERSION="${GPU_PYTHON_VERSION:-3.12}"  # the GPU image's Python
SITE="${GPU_SITE:-/tmp/site}"
MIB=$((1024 * 1024))

# "name==version size teacher?" per pinned line of the list.
pinned() {
    sed -n 's/^\([A-Za-z0-9_.-]*==[^ ]*\) .*# size=\([0-9]*\)\( teacher\)\{0,1\}.*/\1 \2\3/p' "$LIST"
}

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

# Cut files (name size, one a line, on stdin) into loads of LOAD_MIB: prints "load name offset bytes whole".
plan() {
    awk -v room_max=$((LOAD_MIB * MIB)) '
        BEGIN { load = 1; room = room_max }
        { offset = 0
          while (offset < $2) {
              take = $2 - offset < room ? $2 - offset : room
              print load, $1, offset, take, (offset == 0 && take == $2) ? "whole" : "part"
              offset += take; room -= take
              if (room == 0) { load++; room = room_max }
          } }'
}

tree_bytes() {  # what travels besides a load: tracked files and untracked ones git does not ignore
    (cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 -r stat -c %s -- 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
}

dry_run() {
    local wheels=0 teacher=0 name size kind
    echo "wheels the GPU image lacks (cp${PYTHON_VERSION/./}, manylinux x86-64), from scripts/gpu_wheels.txt:"
    while read -r name size kind; do
        printf '  %-24s %12s%s\n' "$name" "$(mib "$size")" "${kind:+  (the default teacher)}"
        if [ -n "$kind" ]; then teacher=$((teacher + size)); else wheels=$((wheels + size)); fi
    done < <(pinned)
    echo "total $(mib "$wheels") in $(pinned | grep -vc ' teacher$') wheels, under the 64 MiB of one transfer: $([ "$wheels" -lt $((64 * MIB)) ] && echo yes || echo NO)"
    echo "teacher $(mib "$teacher") (over one transfer: it travels in parts)"
    local tree
    tree=$(tree_bytes)
    echo "loads of at most $LOAD_MIB MiB, each with the work tree ($(mib "$tree")):"
    pinned | sort -k3,3r -k2,2nr | awk '{ print $1, $2 }' | plan | awk -v tree="$tree" '
        { bytes[$1] += $4; files[$1] = files[$1] " " $2 ($5 == "part" ? "(part)" : "") }
        END { for (l = 1; l in bytes; l++) printf "  load-%d %.1f MiB + tree = %.1f MiB:%s\n", l, bytes[l] / 1048576, (bytes[l] + tree) / 1048576, files[l] }'
}

download() {
    rm -rf "$GPU/wheels" "$GPU"/load-*
    mkdir -p "$GPU/wheels"
    grep -v '^#' "$LIST" | sed 's/  *#.*//' | grep . > "$GPU/requirements.txt"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
        --python-version "$PYTHON_VERSION" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$GPU/wheels" -r "$GPU/requirements.txt"
    (cd "$GPU/wheels" && sha256sum -- *.whl > ../SHA256SUMS)
    # The teacher first, then the largest: the teacher's parts fill the first loads.
    local order=()
    while read -r name size kind; do
        local file
        file=$(cd "$GPU/wheels" && ls -- "$(echo "${name%%==*}" | tr - _)"-"${name##*==}"-*.whl)
        [ "$(stat -c %s "$GPU/wheels/$file")" = "$size" ] || { echo "$file: not the size gpu_wheels.txt says" >&2; exit 1; }
        order+=("$([ -n "$kind" ] && echo 1 || echo 0) $size $file")
    done < <(pinned)
    local loads=0 load file offset bytes whole
    while read -r load file offset bytes whole; do
        mkdir -p "$GPU/load-$load"
        loads=$load
        if [ "$whole" = whole ]; then
            cp "$GPU/wheels/$file" "$GPU/load-$load/"
        else
            dd if="$GPU/wheels/$file" of="$GPU/load-$load/$file.part-$((offset / (LOAD_MIB * MIB)))" bs=1M \
                iflag=skip_bytes,count_bytes skip="$offset" count="$bytes" status=none
        fi
    done < <(printf '%s\n' "${order[@]}" | sort -k1,1r -k2,2nr | awk '{ print $3, $2 }' | plan)
    cp "$GPU/SHA256SUMS" "$GPU/load-$loads/"
    for l in $(seq 1 "$loads"); do
        echo "$GPU/load-$l: $(du -sh "$GPU/load-$l" | cut -f1)"
    done
    echo "next: the device tool's run, once per load, in order (docs/benchmarks.md, GPU acceptance)"
}

install() {
    local dir="$1" part base
    cd "$dir"
    for part in *.part-0; do
        [ -e "$part" ] || continue
        base="${part%.part-0}"
        ls -- "$base".part-* | sort -t- -k2,2n | xargs cat -- > "$base"
        rm -f -- "$base".part-*
    done
    sha256sum --quiet -c SHA256SUMS || {
        echo "a wheel is missing or incomplete in $dir: run every load's call again, one right after the other" >&2
        exit 1
    }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" ./*.whl
    # The project from the work tree that travelled (no build isolation: there is no index to fetch setuptools).
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade --target "$SITE" "$ROOT"
    echo "installed into $SITE: run with PYTHONPATH=$SITE"
}

case "${1:-}" in
    --dry-run) dry_run ;;
    --install) install "${2:?--install DIR}" ;;
    "") download ;;
    *) sed -n '2,10p' "$0" >&2; exit 2 ;;
esac
