#!/usr/bin/env bash
# The one script run on a GPU machine: GPU tests, then the layer benchmark, logs + JSON under $OUT.
#
#   scripts/gpu_check.sh [tests] [tests-1gpu] [tests-ep] [fingerprint] [comm] [bench] [kernels]
#                        [sustained] [sweep] [shapes] [profile] [host] [gemms] [tiles] [probe]
#                        [train] [all]
#                        (default: all)
#
#   tests    = tests-1gpu + tests-ep
#   tests-1gpu  python -m pytest $MEGAMOE_1GPU_TESTS (one GPU; default tests/gpu/test_launch.py
#               tests/gpu/test_triton_backend.py tests/gpu/test_fused.py tests/gpu/test_fp8.py)
#   tests-ep    torchrun --nproc-per-node=$NGPU -m pytest $MEGAMOE_EP_TESTS (>= 2 GPUs; default
#               tests/gpu/test_ep_reference.py tests/gpu/test_triton_ep.py tests/gpu/test_comm.py
#               tests/gpu/test_fused.py; one NCCL group for the session: tests/gpu/conftest.py)
#   fingerprint  SHA-256 of every output and gradient of backends triton and fused on a fixed
#            seeded dsv3-sized input (megamoe/tools/fingerprint.py); with
#            $MEGAMOE_FINGERPRINT_BASE (a directory holding another tree's megamoe package) the
#            same for that tree, and whether the two are bitwise equal
#   comm     torchrun: the dispatch/combine bandwidth sweep (>= 2 GPUs)
#   bench    megamoe bench on $MEGAMOE_PRESETS at W=1, and under torchrun at W=$NGPU (>= 2 GPUs)
#   kernels  adds --kernels (grouped-GEMM kernel records) to the W=1 bench
#   sustained  megamoe.tools.sustained on $MEGAMOE_PRESETS at W=$NGPU: backends $MEGAMOE_SUSTAINED_BACKENDS
#            back to back for $MEGAMOE_SUSTAINED_SECONDS s each, 3 rounds, with power and SM clock
#   sweep    (not part of all) W=$NGPU on $MEGAMOE_SWEEP_PRESET: backend fused over the tunable
#            grid $MEGAMOE_SWEEP_TUNE next to triton and torch-a2a, then every backend over
#            $MEGAMOE_SWEEP_TOKENS tokens per rank (the time-vs-tokens plot)
#   shapes   (not part of all) W=1 on every model of $MEGAMOE_MODELS (default: the whole model
#            table): backends $MEGAMOE_SHAPES_BACKENDS at $MEGAMOE_SHAPES_TOKENS tokens, in the
#            modes $MEGAMOE_SHAPES_MODES (default "throughput latency"), with
#            $MEGAMOE_BENCH_ARGS (e.g. "--precision bf16 fp8"), one bench per model (shapes_<model>.json; a
#            model that runs past STEP_TIMEOUT_S loses only its own records), no float64 check
#            (the weights of the whole table's experts on one GPU; the tests check accuracy)
#   profile  (not part of all) the GPU time of a training step per kernel (megamoe.tools.profile
#            --backward): backend triton on $MEGAMOE_PROFILE_MODELS (default "deepseek-v3
#            qwen3-30b-a3b") in each of $MEGAMOE_PROFILE_PRECISIONS (default "bf16 fp8"), at
#            $MEGAMOE_PROFILE_TOKENS tokens (default: the profile tool's, 4096)
#   host     (not part of all) where the host time of a call goes (megamoe.tools.profile
#            --host): triton and fused, forward and training step, on $MEGAMOE_HOST_MODEL
#   gemms    (not part of all) our six grouped GEMMs against torch._grouped_mm on every model
#            of $MEGAMOE_MODELS (default all) at $MEGAMOE_GEMM_TOKENS tokens (default 4096), in
#            $MEGAMOE_GEMM_PRECISIONS (default bf16; fp8 adds the cuBLAS anchors)
#            (megamoe.tools.bench_kernels; gemms.json)
#   tiles    (not part of all) the tile sweep of the grouped GEMMs (megamoe.tools.sweep_tiles):
#            every candidate tile of each GEMM beside the default, same-bits check, interleaved
#            timing, on $MEGAMOE_TILE_MODELS (default "dsv3 qwen3-30b glm-4.5") at
#            $MEGAMOE_GEMM_TOKENS tokens in $MEGAMOE_GEMM_PRECISIONS (tiles.json); a candidate
#            that changes bits fails the step; $MEGAMOE_TILE_ARGS adds arguments (e.g. "--kernels
#            down wgrad_down --only flatten")
#   probe    (not part of all) the probe benchmarks/probes/$MEGAMOE_PROBE (default
#            epilogue_quantization.py) with $MEGAMOE_PROBE_ARGS (probe.json)
#   train    (not part of all) megamoe train-bench: the DeepSeek-V3- and Qwen3-30B-A3B-shaped
#            transformers models, native MoE against megamoe triton and fused, learned and
#            balanced routing ($MEGAMOE_TRAIN_ARGS, default "--steps 20 --rounds 2"; train.json),
#            then the 200-step bf16 training test (tests/gpu/test_transformers.py; its numbers in
#            transformers_training.json)
#
# Environment (all optional):
#   OUT                  where logs and JSON go (default /tmp/megamoe_gpu_check); the device tool
#                        brings back 8 files: pick the parts (or copy what matters) accordingly
#   MEGAMOE_PRESETS      default "dsv3 qwen3-30b mok-v4"
#   MEGAMOE_1GPU_TESTS   the test files (or file::test ids) of tests-1gpu
#   MEGAMOE_EP_TESTS     the EP test files (or file::test ids) of tests-ep
#   MEGAMOE_BACKENDS     default: every available backend + torch-a2a (bench's own default)
#   MEGAMOE_ITERS        timed iterations (default 20); MEGAMOE_WARMUP (default 3)
#   MEGAMOE_BENCH_ARGS   extra arguments for every bench run (e.g. "--routing zipf")
#   MEGAMOE_COMMIT       recorded as the commit (default: git rev-parse of this tree; set it when
#                        the tree was copied with stale git metadata, as on the device machines)
#   STEP_TIMEOUT_S       wall-clock limit of each step (default 900)
#   TRITON_CACHE_DIR     Triton's compile cache (default $ROOT/.triton_cache, git-ignored). On a
#                        fresh machine compiling dominates the tests (the fused kernel compiles
#                        once per tunable set: the EP tests took > 5 min there). If
#                        $ROOT/.triton_cache.tgz or the pieces $ROOT/.triton_cache_parts/
#                        triton_cache.t{x,g}z.part-* exist (git-ignored; carry them to the
#                        machine) they are unpacked first; MEGAMOE_SAVE_TRITON_CACHE=1 packs the
#                        cache into $OUT/triton_cache.txz.part-* at the end, xz (a third of gzip's
#                        size: the carry limit is 64 MiB with the tree), pieces of 15 MiB (the
#                        device tool brings back files of up to 16 MiB; bring them back into
#                        .triton_cache_parts/)
#   MEGAMOE_PACK         1: at the end, pack every file under $OUT into $OUT/gpu_check.tgz (and
#                        keep summary.txt beside it), for transports that bring back few files
#   MEGAMOE_SUSTAINED_BACKENDS  default "triton fused"; MEGAMOE_SUSTAINED_SECONDS default 2.5
#   MEGAMOE_FINGERPRINT_BASE  a directory with another tree's megamoe package (fingerprint)
#   MEGAMOE_SWEEP_PRESET default dsv3
#   MEGAMOE_SWEEP_TUNE   default "comm_programs=33,66,132 minibatch_rows=256,1024" (--tune
#                        each; at W > 1 comm_programs are the comm kernel's programs)
#   MEGAMOE_SWEEP_TOKENS default "1024 2048 4096 8192"
#   MEGAMOE_MODELS       default: every model of megamoe.shapes.MODEL_SHAPES; an entry
#                        H,I,E,K[,Is] is a custom shape (shapes_custom_HxIxExK.json)
#   MEGAMOE_SHAPES_BACKENDS default "triton fused auto torch-a2a"
#   MEGAMOE_SHAPES_TOKENS default "4096 16384"; MEGAMOE_SHAPES_MODES default "throughput latency"
#   MEGAMOE_HOST_MODEL   default qwen3-30b-a3b
#
# The package is used from this checkout through PYTHONPATH (no install: the GPU machine may have
# no network for build dependencies). Exit status: the number of failed steps (0 = all passed).
set -uo pipefail

# NVLink multicast must stay off on shared machines (see docs/hardware.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/megamoe_gpu_check}"
PY="${PYTHON:-python3}"
PRESETS="${MEGAMOE_PRESETS:-dsv3 qwen3-30b mok-v4}"
ITERS="${MEGAMOE_ITERS:-20}"
WARMUP="${MEGAMOE_WARMUP:-3}"
STEP_TIMEOUT_S="${STEP_TIMEOUT_S:-900}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$ROOT/.triton_cache}"
if [ -z "${MEGAMOE_COMMIT:-}" ]; then
    MEGAMOE_COMMIT="$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
fi
export MEGAMOE_COMMIT

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(all)
for p in "${parts[@]}"; do
    case "$p" in
        all | tests | tests-1gpu | tests-ep | fingerprint | comm | bench | kernels | sustained | sweep | shapes | profile | host | gemms | tiles | probe | train) ;;
        *) echo "gpu_check.sh: unknown part '$p' (expected tests, tests-1gpu, tests-ep, fingerprint, comm, bench, kernels, sustained, sweep, shapes, profile, host, gemms, tiles, probe, train or all)" >&2; exit 2 ;;
    esac
done
want() {  # want PART: was PART (or a part that contains it) asked for?
    local p
    for p in "${parts[@]}"; do
        case "$p" in
            "$1") return 0 ;;
            all) case "$1" in sweep | shapes | profile | host | gemms | tiles | probe | train) ;; *) return 0 ;; esac ;;
            tests) [ "$1" = tests-1gpu ] || [ "$1" = tests-ep ] && return 0 ;;
        esac
    done
    return 1
}
mkdir -p "$OUT" "$TRITON_CACHE_DIR"
pack_out() {  # MEGAMOE_PACK=1: everything under $OUT into $OUT/gpu_check.tgz, summary.txt kept
    [ "${MEGAMOE_PACK:-0}" = 1 ] || return 0
    local pack
    pack="$(mktemp -d)/gpu_check.tgz"
    tar czf "$pack" -C "$OUT" . && find "$OUT" -mindepth 1 ! -name summary.txt -delete \
        && mv "$pack" "$OUT/" && echo "packed into $OUT/gpu_check.tgz"
}
trap pack_out EXIT
if [ -f "$ROOT/.triton_cache.tgz" ]; then
    tar xzf "$ROOT/.triton_cache.tgz" -C "$TRITON_CACHE_DIR" && echo "Triton cache: unpacked $ROOT/.triton_cache.tgz"
fi
for z in tgz:z txz:J; do  # (name: tar's decompression flag)
    if compgen -G "$ROOT/.triton_cache_parts/triton_cache.${z%:*}.part-*" >/dev/null; then
        cat "$ROOT"/.triton_cache_parts/triton_cache."${z%:*}".part-* \
            | tar "x${z#*:}" -C "$TRITON_CACHE_DIR" \
            && echo "Triton cache: unpacked $ROOT/.triton_cache_parts/triton_cache.${z%:*}.part-*"
    fi
done

SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
failures=0
step() {  # step NAME LOG CMD...: run with a time limit, log to LOG, record the outcome
    local name="$1" log="$2"
    shift 2
    echo "=== $name: $*" | tee -a "$log"
    local t0=$SECONDS
    timeout --signal=TERM --kill-after=30 "$STEP_TIMEOUT_S" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    local verdict="ok"
    [ "$rc" -ne 0 ] && verdict="FAILED (exit $rc)" && failures=$((failures + 1))
    echo "$name: $verdict in $((SECONDS - t0)) s" | tee -a "$SUMMARY"
}

NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"
{
    echo "date: $(date -u +%FT%TZ)   commit: $MEGAMOE_COMMIT   GPUs: $NGPU   parts: ${parts[*]}"
    "$PY" -m megamoe info
    command -v nvidia-smi >/dev/null && nvidia-smi topo -m
} >"$OUT/info.txt" 2>&1
cat "$OUT/info.txt"
if [ "$NGPU" -lt 1 ]; then
    echo "gpu_check.sh: no CUDA GPU visible; nothing to do" | tee -a "$SUMMARY"
    exit 1
fi
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node="$NGPU")

EP_TESTS="${MEGAMOE_EP_TESTS:-tests/gpu/test_ep_reference.py tests/gpu/test_triton_ep.py tests/gpu/test_comm.py tests/gpu/test_fused.py}"
ONE_GPU_TESTS="${MEGAMOE_1GPU_TESTS:-tests/gpu/test_launch.py tests/gpu/test_triton_backend.py tests/gpu/test_fused.py tests/gpu/test_fp8.py}"
if want tests-1gpu; then
    # shellcheck disable=SC2086
    step "gpu tests, 1 GPU" "$OUT/tests_1gpu.log" \
        "$PY" -m pytest -q -p no:cacheprovider $ONE_GPU_TESTS
fi
if want tests-ep; then
    if [ "$NGPU" -ge 2 ]; then
        # shellcheck disable=SC2086
        step "EP tests, $NGPU GPUs" "$OUT/tests_ep.log" \
            "${TORCHRUN[@]}" -m pytest -q -p no:cacheprovider $EP_TESTS
    else
        echo "EP tests: skipped (1 GPU)" | tee -a "$SUMMARY"
    fi
fi

if want fingerprint; then
    step "fingerprint" "$OUT/fingerprint.log" \
        "$PY" "$ROOT/megamoe/tools/fingerprint.py" --out "$OUT/fingerprint.json"
    if [ -n "${MEGAMOE_FINGERPRINT_BASE:-}" ]; then
        step "fingerprint of $MEGAMOE_FINGERPRINT_BASE" "$OUT/fingerprint.log" \
            env PYTHONPATH="$MEGAMOE_FINGERPRINT_BASE" \
            "$PY" "$ROOT/megamoe/tools/fingerprint.py" --out "$OUT/fingerprint_base.json"
        step "fingerprints equal" "$OUT/fingerprint.log" \
            cmp "$OUT/fingerprint.json" "$OUT/fingerprint_base.json"
    fi
fi

if want comm; then
    if [ "$NGPU" -ge 2 ]; then
        step "comm bench, $NGPU GPUs" "$OUT/comm.log" \
            "${TORCHRUN[@]}" -m megamoe.tools.bench_comm --out "$OUT/comm.json"
    else
        echo "comm: skipped (1 GPU)" | tee -a "$SUMMARY"
    fi
fi

bench_args=(bench --iters "$ITERS" --warmup "$WARMUP")
# shellcheck disable=SC2206
bench_args+=(--preset $PRESETS)
# shellcheck disable=SC2206
[ -n "${MEGAMOE_BACKENDS:-}" ] && bench_args+=(--backend $MEGAMOE_BACKENDS)
# shellcheck disable=SC2206
[ -n "${MEGAMOE_BENCH_ARGS:-}" ] && bench_args+=($MEGAMOE_BENCH_ARGS)

if want bench || want kernels; then
    w1_args=("${bench_args[@]}")
    want kernels && w1_args+=(--kernels)
    step "bench W=1" "$OUT/bench_w1.log" "$PY" -m megamoe "${w1_args[@]}" --out "$OUT/bench_w1.json"
fi
if want bench && [ "$NGPU" -ge 2 ]; then
    step "bench W=$NGPU" "$OUT/bench_w$NGPU.log" \
        "${TORCHRUN[@]}" -m megamoe "${bench_args[@]}" --out "$OUT/bench_w$NGPU.json"
fi

if want sustained; then
    run_sustained=("$PY" -m megamoe.tools.sustained)
    [ "$NGPU" -ge 2 ] && run_sustained=("${TORCHRUN[@]}" -m megamoe.tools.sustained)
    for preset in $PRESETS; do
        # shellcheck disable=SC2086
        step "sustained $preset W=$NGPU" "$OUT/sustained_$preset.log" "${run_sustained[@]}" \
            --preset "$preset" --backend ${MEGAMOE_SUSTAINED_BACKENDS:-triton fused} \
            --seconds "${MEGAMOE_SUSTAINED_SECONDS:-2.5}" --out "$OUT/sustained_$preset.json"
    done
fi

if want sweep; then
    if [ "$NGPU" -ge 2 ]; then
        sweep_preset="${MEGAMOE_SWEEP_PRESET:-dsv3}"
        tune_args=()
        for spec in ${MEGAMOE_SWEEP_TUNE:-comm_programs=33,66,132 minibatch_rows=256,1024}; do
            tune_args+=(--tune "$spec")
        done
        sweep_common=(bench --iters "$ITERS" --warmup "$WARMUP" --preset "$sweep_preset")
        # shellcheck disable=SC2206
        [ -n "${MEGAMOE_BENCH_ARGS:-}" ] && sweep_common+=($MEGAMOE_BENCH_ARGS)
        step "tunable sweep W=$NGPU" "$OUT/sweep_tune.log" "${TORCHRUN[@]}" -m megamoe \
            "${sweep_common[@]}" --backend fused triton torch-a2a "${tune_args[@]}" \
            --out "$OUT/sweep_tune.json"
        # shellcheck disable=SC2206
        tokens=(${MEGAMOE_SWEEP_TOKENS:-1024 2048 4096 8192})
        step "tokens sweep W=$NGPU" "$OUT/sweep_tokens.log" "${TORCHRUN[@]}" -m megamoe \
            "${sweep_common[@]}" --backend fused triton torch-a2a --tokens "${tokens[@]}" \
            --out "$OUT/sweep_tokens.json"
    else
        echo "sweep: skipped (1 GPU)" | tee -a "$SUMMARY"
    fi
fi

if want shapes; then
    models="${MEGAMOE_MODELS:-$("$PY" -c 'from megamoe.shapes import MODEL_SHAPES; print(*MODEL_SHAPES)')}"
    for model in $models; do
        how=(--model "$model")
        name="$model"
        case "$model" in *,*) how=(--shape "$model") name="custom_${model//,/x}" ;; esac
        # shellcheck disable=SC2086
        step "shapes $model W=1" "$OUT/shapes.log" "$PY" -m megamoe bench "${how[@]}" \
            --tokens ${MEGAMOE_SHAPES_TOKENS:-4096 16384} \
            --backend ${MEGAMOE_SHAPES_BACKENDS:-triton fused auto torch-a2a} \
            --mode ${MEGAMOE_SHAPES_MODES:-throughput latency} --iters "$ITERS" \
            --warmup "$WARMUP" --no-check ${MEGAMOE_BENCH_ARGS:-} --out "$OUT/shapes_$name.json"
    done
fi

if want profile; then
    for model in ${MEGAMOE_PROFILE_MODELS:-deepseek-v3 qwen3-30b-a3b}; do
        for precision in ${MEGAMOE_PROFILE_PRECISIONS:-bf16 fp8}; do
            # shellcheck disable=SC2086
            step "profile $model $precision step" "$OUT/profile.log" "$PY" -m megamoe.tools.profile \
                --backward --model "$model" --backend triton --precision "$precision" \
                ${MEGAMOE_PROFILE_TOKENS:+--tokens "$MEGAMOE_PROFILE_TOKENS"}
        done
    done
fi

if want host; then
    for backend in triton fused; do
        step "host time $backend forward" "$OUT/host.log" "$PY" -m megamoe.tools.profile --host \
            --model "${MEGAMOE_HOST_MODEL:-qwen3-30b-a3b}" --backend "$backend" \
            --out "$OUT/host_${backend}_forward"
        step "host time $backend step" "$OUT/host.log" "$PY" -m megamoe.tools.profile --host \
            --backward --model "${MEGAMOE_HOST_MODEL:-qwen3-30b-a3b}" --backend "$backend" \
            --out "$OUT/host_${backend}_step"
    done
fi

if want gemms; then
    # shellcheck disable=SC2086
    step "grouped GEMMs vs torch._grouped_mm" "$OUT/gemms.log" "$PY" -m megamoe.tools.bench_kernels \
        --model ${MEGAMOE_MODELS:-all} --tokens "${MEGAMOE_GEMM_TOKENS:-4096}" \
        --precision ${MEGAMOE_GEMM_PRECISIONS:-bf16} --out "$OUT/gemms.json"
fi

if want tiles; then
    # shellcheck disable=SC2086
    step "tile sweep" "$OUT/tiles.log" "$PY" -m megamoe.tools.sweep_tiles \
        --model ${MEGAMOE_TILE_MODELS:-dsv3 qwen3-30b glm-4.5} \
        --tokens "${MEGAMOE_GEMM_TOKENS:-4096}" --precision ${MEGAMOE_GEMM_PRECISIONS:-bf16} \
        ${MEGAMOE_TILE_ARGS:-} --out "$OUT/tiles.json"
fi

if want probe; then
    probe="${MEGAMOE_PROBE:-epilogue_quantization.py}"
    # shellcheck disable=SC2086
    step "probe $probe" "$OUT/probe.log" "$PY" "$ROOT/benchmarks/probes/$probe" \
        ${MEGAMOE_PROBE_ARGS:-} --out "$OUT/probe.json"
fi

if want train; then
    # shellcheck disable=SC2086
    step "train-bench" "$OUT/train.log" "$PY" -m megamoe train-bench \
        ${MEGAMOE_TRAIN_ARGS:---steps 20 --rounds 2} --out "$OUT/train.json"
    step "training test, 200 steps" "$OUT/train_test.log" env MEGAMOE_RESULTS_DIR="$OUT" \
        "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_transformers.py
fi

if [ "${MEGAMOE_SAVE_TRITON_CACHE:-0}" = 1 ]; then
    tar c -C "$TRITON_CACHE_DIR" . | xz -T0 -6 | split -b 15M - "$OUT/triton_cache.txz.part-" \
        && echo "Triton cache: $(du -ch "$OUT"/triton_cache.txz.part-* | tail -1 | cut -f1) in $OUT/triton_cache.txz.part-*"
fi
echo "--- summary ($failures failed step(s)); files in $OUT:"
cat "$SUMMARY"
ls -l "$OUT"
exit "$failures"
