#!/usr/bin/env bash
# Everything a lent GPU machine is for, in one call that fits its lease (about 9 minutes):
#
#   bash bench/gpu_check.sh OUT_DIR [COMMIT]
#
# Why a script: a lent machine is held for minutes, starts bare (torch 2.11, transformers
# 5.17, no Ray, no network) and keeps nothing, so the checks run in one go, each under a
# time box of its own, each writing its log and JSON into OUT_DIR as it goes (a box that
# runs out loses only its own section). The checks, in the order CHECKS names them
# (default "graph_tests graphs eager tests"):
#   graph_tests: tests/specdec/test_cuda_graphs.py on the GPU (the graphs are exact);
#   draft_tests: a draft round as one recorded graph (GraphedDraftSteps) against step by
#                step, and attention by row positions, on the GPU;
#   graphs:      bench.gpu with the runners on CUDA graphs (cuda_graph), a profile of a
#                verification and a draft step first, peers included;
#   graphs_rows: the same on attention by rows through SDPA alone (--attention rows: no
#                slot-attention kernels), without the peers: the kernels' reference;
#   eager:       bench.gpu with the eager runners (the reference), peers included;
#   compiled:    bench.gpu with Inductor's kernels (torch_compile; on CUDA recorded as CUDA
#                graphs), without the peers;
#   tests:       all of tests/specdec on the GPU.
# Measured on an H100 (2026-11-26): the eager section took 276 s up to the static-compile
# peer (whose warm-up is 32 s); the compiled section did not finish compiling the 8B and
# 1B graphs in 150 s; the tests ran 16 in 100 s with -n 4. A lease has 15 minutes, a
# machine's start included: give the boxes to what the session needs most.
# Boxes (seconds) through the environment: GRAPH_TESTS_S, DRAFT_TESTS_S, GRAPHS_S, GRAPHS_ROWS_S, EAGER_S, COMPILED_S,
# TESTS_S; BENCH_ARGS are added to every bench.gpu run, GRAPHS_ARGS and EAGER_ARGS to
# one; TEST_DEVICE (default cuda) is the tests' --device, so that
# `BENCH_ARGS="--device cpu --smoke" TEST_DEVICE=cpu` tries it here.
set -u
out=${1:?usage: bench/gpu_check.sh OUT_DIR [COMMIT]}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export BENCH_COMMIT=${2:-${BENCH_COMMIT:-}}
py=${PYTHON:-python3}

box() {  # box NAME SECONDS COMMAND...: run COMMAND with a time limit, log to OUT_DIR/NAME.log
    local name=$1 seconds=$2
    shift 2
    local t0=$SECONDS
    timeout -k 10 "$seconds" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "[gpu_check] $name: exit $rc after $((SECONDS - t0)) s (box $seconds s)" | tee -a "$out/summary.txt"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    "$py" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
} 2>&1 | tee "$out/summary.txt"

# Four workers where pytest-xdist is installed (the lent machine's image has it).
workers=$("$py" -c 'import xdist' 2>/dev/null && echo "-n 4")
pytest=("$py" -m pytest -q --maxfail=20 -p no:cacheprovider --device "${TEST_DEVICE:-cuda}")
# shellcheck disable=SC2086  # BENCH_ARGS are words
for check in ${CHECKS:-graph_tests graphs eager tests}; do
    case $check in
    graph_tests) box graph_tests "${GRAPH_TESTS_S:-100}" "${pytest[@]}" tests/specdec/test_cuda_graphs.py ;;
    draft_tests) box draft_tests "${DRAFT_TESTS_S:-90}" "${pytest[@]}" tests/specdec/test_draft_steps.py \
        tests/specdec/test_row_attention.py tests/specdec/test_slot_attention.py \
        -k "cuda_graph or row_attention or grouped or slot_attention or kernels" ;;
    graphs) box graphs "${GRAPHS_S:-220}" "$py" -m bench.gpu --execution-mode cuda_graph --profile \
        --out "$out/graphs" ${BENCH_ARGS:-} ${GRAPHS_ARGS:-} ;;
    graphs_rows) box graphs_rows "${GRAPHS_ROWS_S:-120}" "$py" -m bench.gpu --execution-mode cuda_graph \
        --attention rows --profile --no-peers --out "$out/graphs_rows" ${BENCH_ARGS:-} ${GRAPHS_ROWS_ARGS:-} ;;
    eager) box eager "${EAGER_S:-300}" "$py" -m bench.gpu --execution-mode eager --out "$out/eager" \
        ${BENCH_ARGS:-} ${EAGER_ARGS:-} ;;
    compiled) box compiled "${COMPILED_S:-160}" "$py" -m bench.gpu --execution-mode torch_compile \
        --no-peers --out "$out/compiled" ${BENCH_ARGS:-} ${COMPILED_ARGS:-} ;;
    tests) box tests "${TESTS_S:-100}" "${pytest[@]}" $workers tests/specdec ;;
    *) echo "[gpu_check] unknown check $check" | tee -a "$out/summary.txt" ;;
    esac
done

for log in graph_tests draft_tests tests; do
    [ -f "$out/$log.log" ] && tail -n 3 "$out/$log.log" >>"$out/summary.txt"
done
"$py" - "$out" <<'EOF' | tee -a "$out/summary.txt"
import json, sys
from pathlib import Path

for mode in ("graphs", "graphs_rows", "eager", "compiled"):
    found = sorted((Path(sys.argv[1]) / mode).glob("gpu*.json"))
    path = found[0] if found else Path("missing")
    if not path.exists():
        print(f"{mode}: no results")
        continue
    r = json.loads(path.read_text())["results"]
    print(f"{mode}: bandwidth {r.get('bandwidth_gb_s', 0):.0f} GB/s")
    for kind, rows in r.get("passes", {}).items():
        for key, v in rows.items():
            if "floor_ms" in v:
                print(f"  {kind} {key}: {v['ms']:.2f} ms, floor {v['floor_ms']:.2f} ms ({v['floor_fraction']:.2f})")
            else:  # a fused draft round: its steps against as many single steps
                print(f"  {kind} {key}: {v['ms']:.2f} ms ({v['vs_single_steps']:.2f}x single steps)")
    for batch, row in r.get("decoding", {}).items():
        parts = [f"plain {row['plain']:.0f}"]
        parts += [f"{k} {v['tokens_per_s']:.0f} ({v['speedup_vs_plain']:.2f}x)" for k, v in row.items() if k != "plain"]
        print(f"  {batch}: tokens/s " + ", ".join(parts))
    for key, v in r.get("transformers_batch1", {}).items():
        print(f"  transformers {key}: {v:.1f}" if isinstance(v, float) else f"  transformers {key}: {v}")
    for name, prof in r.get("profile", {}).items():
        print(f"  profile {name}: wall {prof['wall_ms']} ms, device {prof['device_ms_per_pass']} ms, "
              f"{prof['kernels_per_pass']} kernels")
        for k in prof["top_kernels"][:6]:
            print(f"    {k['ms_per_pass']:.3f} ms x{k['calls_per_pass']}: {k['name'][:90]}")
    for name, rec in r.get("record_s", {}).items():
        print(f"  {name}: {rec['graphs']} graphs recorded in {rec['total_s']} s; "
              f"memory {rec.get('memory_gb')} GB, reserve {rec.get('reserve_gb')} GB")
EOF
