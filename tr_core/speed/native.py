"""``native.c`` built on the machine that runs it, and called through ctypes.

A one-token step of the embedded model spends more time in ~2,700 small tensor operations (RMS norms, the rotary
embedding, the cache update, attention's masking and softmax), each a few microseconds of dispatch, than in
arithmetic. ``native.c`` does each group of them in one call on raw fp32 buffers. It is compiled once per machine
(``gcc -O3 -march=native``, so it uses this CPU's vector units) into the cache folder, keyed by its source, the
compiler and the CPU; where there is no C compiler, or the build or its self-check fails, ``library()`` is None and
the lean forward keeps its torch operations (``status()`` says why). Where the CPU has AVX-512, it also holds linear
layers (fp32 and fp16 weights, ``linear``; bf16 weights and products where it also has AVX-512 BF16, and on AMX
tiles where it has AMX and the kernel grants the process the tile state): candidates the kernel chooser measures
beside torch's (layouts.py's "native", "fp16n", "bf16n" and "amxn"), and a measurement of the CPU's peak rate of their
multiply instructions (``peak_products``, for ``calibrate --show``'s limits).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from .. import topk
from ..models import default_cache_dir
from . import pages
from .tiles import weight_tiles

SOURCE = Path(__file__).with_name("native.c")
# -ffp-contract=off: no fused multiply-adds formed by the compiler (a loop's vector body and remainder must round
# alike, and gcc in GNU mode or clang would contract)
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-shared", "-fPIC",
         "-std=c11"]
# the linear layers' threads: OpenMP. With gcc it binds to the runtime torch has loaded (both name libgomp.so.1: one
# pool of threads for both); clang's -fopenmp links libomp, a second runtime beside torch's. A compiler without
# OpenMP builds the library single-threaded.
OPENMP = "-fopenmp"
_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "tr_add_rms_norm": [_P, _P, _P, _F, _I, _I, _P],
    "tr_silu_mul": [_P, _I, _I, _P],
    "tr_rope_store": [_P, _P, _P, _L, _P, _P, _I, _I, _I, _I, _F, _P, _I, _P, _P, _L, _L],
    "tr_attend": [_P, _I, _P, _P, _L, _L, _P, _P, _I, _I, _I, _I, _P, _I],
}
# built only where the CPU has them (AVX-512 F, BW and VL): linear layers, fp16 and fp32 weights (layouts.py's
# "fp16n" and "native"), and the decoder layers' stack on them (the lean forward's whole pass in one call)
OPTIONAL = {"tr_linear_f16": [_P, _P, _I, _I, _I, _P, _I], "tr_linear_f32": [_P, _P, _I, _I, _I, _P, _I],
            # and where the CPU has AVX-512 BF16: bf16 weights and products (layouts.py's "bf16n")
            "tr_linear_bf16": [_P, _P, _I, _I, _I, _P, _I],
            # and where the CPU has AMX (amx_tile, amx_bf16): bf16 weights in AMX tiles (layouts.py's "amxn"), once
            # the kernel grants the process the tile state (tr_amx_ready, asked by ``_optional_check``)
            "tr_amx_ready": [], "tr_linear_amx": [_P, _P, _I, _I, _I, _P, _I],
            # and there, attention with its shared part on AMX tiles (the amx format's; ``attention_on_tiles``)
            "tr_attend_amx": SIGNATURES["tr_attend"], "tr_attend_tiles": [_I],
            "tr_layers": [_I, _P, _P, _P, _L, _I, _I, _I, _I, _I, _I, _F, _I, _P, _P, _P, _P, _P, _I, _L, _P, _P, _P,
                          _P, _P, _P, _P, _P, _P, _F, _I, _P, _L, _L],
            # the CPU's peak rate of those layers' products (``peak_products``; returns an int)
            "tr_peak_products": [_I, _L, _I, _P],
            # from how many rows the linear layers prefetch their weights (``fetch_from_rows``: chosen here)
            "tr_fetch_from_rows": [_I],
            # past how many floats a call the small operations are shared among the threads (``choose_sharing``:
            # chosen here, by timing SiLU's rows shared and not)
            "tr_small_ops_shared": [_L], "tr_silu_mul_rows": [_P, _I, _I, _P, _I],
            # each row's k best values and their ids, for ``topk.top_k`` (``top_k``; returns an int)
            "tr_top_k": [_P, _I, _I, _I, _P, _P, _I]}
# the functions that return something (the others return nothing)
RETURNS = {"tr_peak_products": ctypes.c_int, "tr_amx_ready": ctypes.c_int, "tr_top_k": ctypes.c_int}
# optional functions no step calls: left out of the timing caches' tag (``tag``; the prefetch's choice is in it)
UNTIMED = {"tr_peak_products", "tr_fetch_from_rows", "tr_amx_ready", "tr_attend_tiles", "tr_small_ops_shared",
           "tr_silu_mul_rows"}
# by the weights' dtype, and "amx" for bf16 weights in AMX tiles (``layouts.WeightTiles.kernel``)
LINEAR = {torch.float16: "tr_linear_f16", torch.float32: "tr_linear_f32", torch.bfloat16: "tr_linear_bf16",
          "amx": "tr_linear_amx"}
_WHY: list[str] = []
_SOURCE_TEXT = SOURCE.read_text() if SOURCE.exists() else ""  # a copy of the package without the C: torch's ops
_SOURCE_TAG = "c" + hashlib.sha256((_SOURCE_TEXT + " ".join(FLAGS) + OPENMP).encode()).hexdigest()[:8]


def cache_dir() -> Path:
    return default_cache_dir() / "native"


def _target(compiler: list[str]) -> str:
    """What ``-march=native`` means on this machine, as the compiler resolves it (its version and target options):
    a library built on another CPU, say in a copied cache folder, is not taken for this one's."""
    env = {**os.environ, "LC_ALL": "C"}  # the same words whatever the user's language
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=30, env=env)
    version = run([*compiler, "--version"]).stdout
    target = run([*compiler, "-march=native", "-Q", "--help=target"]).stdout  # gcc's; other compilers: the CPU's
    return version + target + _cpu_flags() + platform.machine()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build(compiler: list[str]) -> Path:
    key = hashlib.sha256((_SOURCE_TEXT + " ".join(FLAGS) + OPENMP + _target(compiler)).encode()).hexdigest()[:16]
    target = cache_dir() / f"native-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then renamed: safe for parallel builds
        built = Path(tmp) / "native.so"
        for extra in ([OPENMP], []):  # without OpenMP where the compiler has none
            done = subprocess.run([*compiler, *FLAGS, *extra, str(SOURCE), "-o", str(built), "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if not done.returncode:
                break
        if done.returncode:
            raise RuntimeError(f"{' '.join(compiler)} failed: {done.stderr.strip()[-300:]}")
        os.replace(built, target)
    for old in target.parent.glob("native-*.so"):  # builds of other sources or compilers, untouched for a week
        if old != target and time.time() - old.stat().st_mtime > 7 * 86400:
            old.unlink(missing_ok=True)
            for kept in old.parent.glob(f"{old.stem}.*"):  # its prefetch and sharing choices (``_fetch_choice``...)
                kept.unlink(missing_ok=True)
    return target


def _load(compiler: list[str]):
    path = _build(compiler)
    try:
        return ctypes.CDLL(str(path))
    except OSError:  # a damaged file in the cache: built once more
        path.unlink(missing_ok=True)
        return ctypes.CDLL(str(_build(compiler)))


@functools.cache
def library():
    """The built library with its functions' signatures set, or None where it cannot be had here (``status``)."""
    if os.environ.get("TR_NATIVE", "1") == "0":
        _WHY.append("turned off (TR_NATIVE=0)")
        return None
    if not _SOURCE_TEXT:
        _WHY.append(f"{SOURCE.name} is missing")
        return None
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("gcc") or shutil.which("cc") or ""]
    if not compiler[0]:
        _WHY.append("no C compiler on this machine")
        return None
    try:
        lib = _load(compiler)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _WHY.append(f"not built: {exc}")
        return None
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    if not _self_check(lib):
        _WHY.append("its self-check against torch failed")
        return None
    _OPTIONAL_HERE.clear()
    for name, args in OPTIONAL.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, RETURNS.get(name)
            if _optional_check(name, fn, lib):  # one that fails its check is left out alone
                _OPTIONAL_HERE[name] = fn
    _turn_tiles(True)  # not set_attention_on_tiles: it loads the library first, and this call is that load
    if "tr_fetch_from_rows" in _OPTIONAL_HERE:
        _FETCH.update(_fetch_choice(Path(lib._name)))
        _OPTIONAL_HERE["tr_fetch_from_rows"](_FETCH["rows"])
    if "tr_silu_mul_rows" in _OPTIONAL_HERE:
        _SHARING.update(_sharing_choice(Path(lib._name)))
        _OPTIONAL_HERE["tr_small_ops_shared"](_SHARING["floats"])
    if "tr_top_k" in _OPTIONAL_HERE:
        topk.use(top_k)
    return lib


_OPTIONAL_HERE: dict = {}  # the optional functions built here that passed their check (``library``)


def linear(kind: torch.dtype | str):
    """The C linear layer for weights of ``kind`` (fp16: ``tr_linear_f16``, fp32: ``tr_linear_f32``, bf16:
    ``tr_linear_bf16``, ``"amx"``: ``tr_linear_amx``), or None where the library or the CPU lacks it (or it failed
    its check)."""
    return _OPTIONAL_HERE.get(LINEAR.get(kind)) if library() is not None else None


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``tr_top_k``: each row's ``k`` largest values of ``logits`` (n, V: fp32, contiguous, on the CPU), best first,
    and their ids, the lowest first among equal values; None where it declines (no such call here, another tensor,
    ``k`` past 64 or the row's length, a row with a NaN or fewer than ``k`` values above -infinity): the caller then
    asks torch. ``topk.top_k`` calls it once the library has loaded (``topk.use``): at 16 rows of the embedded
    model's 49,152 logits 0.03 ms against 0.17 for torch's (in the cache)."""
    fn = _OPTIONAL_HERE.get("tr_top_k")
    if (fn is None or logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu"
            or not logits.is_contiguous() or not 1 <= k <= min(64, logits.shape[1])):
        return None
    n, v = logits.shape
    values, ids = torch.empty(n, k), torch.empty(n, k, dtype=torch.int64)
    if n and fn(logits.data_ptr(), n, v, k, values.data_ptr(), ids.data_ptr(), torch.get_num_threads()):
        return None
    return values, ids


_TILES = {"on": False}  # whether the amx format attends on tiles (``set_attention_on_tiles``)


def attention_on_tiles():
    """``tr_attend_amx`` (``tr_attend`` with the keys before the window on AMX tiles: bf16 queries, keys, softmax
    weights and values, fp32 sums), which the fast mode's amx format attends with, in ``tr_layers`` and call by call
    alike; None where it is not built here, failed its check, or is turned off."""
    if library() is None or not _TILES["on"]:
        return None
    return _OPTIONAL_HERE.get("tr_attend_amx")


def attention_tiles_built() -> bool:
    """Whether attention on AMX tiles is built here and passed its check (on or off: ``attention_on_tiles``)."""
    return library() is not None and "tr_attend_amx" in _OPTIONAL_HERE and "tr_attend_tiles" in _OPTIONAL_HERE


def set_attention_on_tiles(on: bool) -> bool:
    """Turn the amx format's attention on tiles on (where it is built and passed its check: the default) or off (it
    then runs ``tr_attend``, fp32, as the other formats do), for the whole process: for side-by-side timings and
    tests. Returns whether it is on. A model's plan measured one way is not re-measured the other way."""
    library()  # loaded first: loading turns it on
    return _turn_tiles(on)


def _turn_tiles(on: bool) -> bool:
    """``set_attention_on_tiles`` once the library's functions are known (``library`` calls it while it loads)."""
    on = bool(on) and "tr_attend_amx" in _OPTIONAL_HERE and "tr_attend_tiles" in _OPTIONAL_HERE
    if "tr_attend_tiles" in _OPTIONAL_HERE:
        _OPTIONAL_HERE["tr_attend_tiles"](int(on))
    _TILES["on"] = on
    return on


def stacked():
    """``tr_layers`` (the decoder layers of a pass in one call, on the C linear layers), or None where it is not
    built here or failed its check."""
    return _OPTIONAL_HERE.get("tr_layers") if library() is not None else None


# the products a peak measures (``peak_products``): its kind in native.c, products per instruction, and its name
PEAK_KINDS = {"fma": (0, 16, "fp32 multiply-adds"), "bf16dot": (2, 32, "bf16 dot products"),
              "amx": (3, 16 * 16 * 32, "AMX bf16 tile products")}
PEAK_CHAINS = 16  # the instructions a thread runs a round in tr_peak_products (native.c's CHAINS16)


def peak_products(kind: str, threads: int | None = None, repeats: int = 5) -> float | None:
    """The CPU's peak rate of one linear-layer instruction on ``threads`` threads side by side (default torch's), in
    products a second, measured now: ``"fma"`` fp32 fused multiply-adds (the fp32 and fp16-weight layers),
    ``"bf16dot"`` bf16 dot products (the bf16-product layers), ``"amx"`` AMX tile products (the AMX layers, on tiles of
    mixed values: ``amx_peak`` in native.c). The arithmetic alone, on registers: a ceiling no linear
    layer can pass. None where it is not measured here: no library, a CPU without AVX-512 (the C linear layers'
    condition) or without the instruction, or a library built without OpenMP (its threads would not run together)."""
    fn = _OPTIONAL_HERE.get("tr_peak_products") if library() is not None else None
    if fn is None:
        return None
    code, per_instruction, _ = PEAK_KINDS[kind]
    threads = threads or torch.get_num_threads()
    sink = torch.zeros(threads)
    rounds, best = 1 << 12, float("inf")
    while True:  # rounds for a call of at least 20 ms, then the fastest of `repeats`
        t0 = time.perf_counter()
        ran = fn(code, rounds, threads, sink.data_ptr())
        if ran != threads:  # the kind is not built here (0), or the threads ran one after another
            return None
        if time.perf_counter() - t0 >= 0.02:
            break
        rounds *= 2
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(code, rounds, threads, sink.data_ptr())
        best = min(best, time.perf_counter() - t0)
    return threads * rounds * PEAK_CHAINS * per_instruction / best


def paired_ratio(tried, without, pairs: int) -> float:
    """The median over ``pairs`` pairs of ``tried() / without()`` (each a time), the pairs alternating which runs
    first, so a drift of the machine's speed weighs on both alike.

    >>> calls = []
    >>> def timed(name):  # whichever runs second in a pair takes twice as long
    ...     calls.append(name)
    ...     return 2.0 if len(calls) % 2 == 0 else 1.0
    >>> paired_ratio(lambda: timed("on"), lambda: timed("off"), 2), calls
    (1.25, ['on', 'off', 'off', 'on'])
    """
    ratios = []
    for i in range(pairs):
        if i % 2:
            off = without()
            on = tried()
        else:
            on = tried()
            off = without()
        ratios.append(on / off)
    return statistics.median(ratios)


# Where the linear kernels start to prefetch their weights (native.c's FETCH): measured once per built library and
# kept beside it. NEVER: no kernel does; FETCH_ROWS: the row counts tried and the call each is timed with.
NEVER = 13
FETCH_ROWS = ((1, 1), (2, 3), (5, 6), (9, 12))  # from 1 row (timed on 1), from 2 (on 3), from 5 (on 6), from 9 (on 12)
FETCH_GAIN = 0.97  # a prefetch is kept where it takes at most this share of the time without
_FETCH: dict = {"rows": NEVER, "why": "not measured"}


def choose_fetch(timed, pairs: int = 7) -> tuple[int, str]:
    """From how many rows the linear kernels should prefetch: ``timed(setting, rows)`` (ms, a call of ``rows`` rows
    with the kernels prefetching from ``setting`` rows) against the same call without (``NEVER``) for each of
    ``FETCH_ROWS``, in ``pairs`` pairs alternating which goes first (the median ratio); the prefetch pays at a call
    that takes at most ``FETCH_GAIN`` of its time without. Kept from the first setting from whose call on it pays at
    every later call too (a CPU where it pays at 6 rows but costs at 3 prefetches from 5), else NEVER. Returns it and
    the measured ratios, in words.

    >>> choose_fetch(lambda setting, rows: 8.0 if setting == NEVER else 7.0, pairs=3)
    (1, '1 row 0.88x, 3 rows 0.88x, 6 rows 0.88x, 12 rows 0.88x')
    >>> choose_fetch(lambda setting, rows: 8.0 if setting == NEVER or rows == 3 else 7.0, pairs=3)[0]
    5
    >>> choose_fetch(lambda setting, rows: 8.0, pairs=3)
    (13, '1 row 1.00x, 3 rows 1.00x, 6 rows 1.00x, 12 rows 1.00x')
    """
    ratios = {(setting, rows): paired_ratio(lambda: timed(setting, rows), lambda: timed(NEVER, rows), pairs)
              for setting, rows in FETCH_ROWS}
    said = ", ".join(f"{rows} row{'s' * (rows > 1)} {ratio:.2f}x" for (_, rows), ratio in ratios.items())
    settings = list(ratios)
    paying = [setting for i, (setting, _) in enumerate(settings)
              if all(ratios[later] <= FETCH_GAIN for later in settings[i:])]
    return (paying[0] if paying else NEVER), said


# The layers the prefetch is timed on: sets of the embedded model's body shapes (out, in) in fp32, 14 MB a set, as
# many as twice the CPU's last-level cache holds (FETCH_BYTES bounds it), so they are read from memory as a model's
# weights are. The kernels stream each block of 32 outputs' weights in one run of in x 128 bytes: short runs (576
# inputs) gain from the prefetch where long ones may not (a single 8192 x 2048 layer read 0.98x at 3 rows here where
# 141 MB of these read 0.68x), and weights the cache holds gain little (71 MB of them, inside this CPU's 300 MB L3:
# 0.98x at 3 rows).
FETCH_SHAPES = ((576, 576), (960, 576), (3072, 576), (576, 1536))
FETCH_BYTES = (128 << 20, 640 << 20)


def _last_level_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The largest CPU cache's size in bytes, as Linux's sysfs says (None where it does not)."""
    sizes = []
    for entry in caches.glob("index*/size"):
        try:
            text = entry.read_text().strip()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return max(sizes) if sizes else None


def _fetch_sets() -> int:
    """How many sets of FETCH_SHAPES the prefetch is timed on: twice the last-level cache (FETCH_BYTES[0] where the
    system does not say it), within FETCH_BYTES."""
    per_set = sum(out * inputs * 4 for out, inputs in FETCH_SHAPES)
    low, high = FETCH_BYTES
    return -(-min(max(2 * (_last_level_cache_bytes() or low), low), high) // per_set)


def _kept(path: Path, tried: str, measure) -> tuple[int, str]:
    """A choice measured on this machine and kept in ``path`` beside the built library: the kept (value, why) where
    it was measured over what is ``tried`` now, else ``measure()`` (value, why), kept for the next process."""
    try:
        value, why, was = path.read_text().split("\n")
        if was == tried:
            return int(value), why
    except (OSError, ValueError):
        pass
    value, why = measure()
    try:
        path.write_text(f"{value}\n{why}\n{tried}")
    except OSError:
        pass
    return value, why


def _fetch_choice(library_path: Path) -> dict:
    """``choose_fetch`` on this machine, timed on fp32 linear layers of a small model's shapes (``_fetch_sets`` sets
    of FETCH_SHAPES: out of the caches and on the pages a model's weights get, like them), kept beside the built
    library (so measured once per library and CPU, again when what is tried changes)."""
    set_rows, linear = _OPTIONAL_HERE["tr_fetch_from_rows"], _OPTIONAL_HERE.get("tr_linear_f32")
    if linear is None:
        return {"rows": NEVER, "why": "not measured: no fp32 linear layer here"}
    sets = _fetch_sets()

    def measure() -> tuple[int, str]:
        with pages.huge_pages():  # placed as a model's packed weights are (``kernels.apply_plan``)
            layers = [(out, inputs, weight_tiles(torch.full((out, inputs), 0.5), torch.float32).tiles)  # real pages
                      for _ in range(sets) for out, inputs in FETCH_SHAPES]
        widest = max(max(out, inputs) for out, inputs in FETCH_SHAPES)
        x, y = torch.randn(12, widest), torch.empty(12, widest)
        threads = torch.get_num_threads()

        def timed(setting: int, rows: int) -> float:
            set_rows(setting)
            t0 = time.perf_counter()
            for out, inputs, tiles in layers:
                linear(x.data_ptr(), tiles.data_ptr(), rows, inputs, out, y.data_ptr(), threads)
            return (time.perf_counter() - t0) * 1e3

        timed(NEVER, 12)  # the first call pays for the threads' start
        rows, said = choose_fetch(timed)
        megabytes = sum(tiles.nbytes for *_, tiles in layers) >> 20
        layers.clear()  # the layers (up to FETCH_BYTES[1]) go back before a model loads
        return rows, f"measured here, prefetching against not, {megabytes} MB of fp32 layers: {said}"

    rows, why = _kept(library_path.with_suffix(".fetch"), repr((FETCH_ROWS, FETCH_SHAPES, sets)), measure)
    set_rows(rows)
    return {"rows": rows, "why": why}


# Past how many floats a call the small operations (norms, rotary embedding, SiLU, the AMX layer's rounding of its
# inputs) are shared among the threads (native.c's small_ops_shared): measured once per built library and kept
# beside it. SHARE_NEVER: never; SHARE_WIDTH, SHARE_ROWS: the SiLU call timed (rows of 2 x 1536 floats, the embedded
# model's gate and up) and its row counts; SHARE_DEFAULT: native.c's until measured (SMALL_OPS_SHARED).
SHARE_NEVER = (1 << 63) - 1
SHARE_WIDTH = 2 * 1536
SHARE_ROWS = (3, 6, 11, 22, 43)
SHARE_GAIN = 0.97  # sharing is kept where it takes at most this share of the time on one thread
SHARE_DEFAULT = 1 << 15
_SHARING: dict = {"floats": SHARE_DEFAULT, "why": "not measured"}


def choose_sharing(timed, pairs: int = 7) -> tuple[int, str]:
    """Past how many floats a call the small operations should be shared among the threads: ``timed(shared, rows)``
    (ms, SiLU over ``rows`` rows of SHARE_WIDTH floats, shared among the threads or on one) in ``pairs`` pairs per
    row count of SHARE_ROWS, alternating which goes first; sharing pays at a row count where the median ratio is at
    most SHARE_GAIN. It is kept from the fewest rows from which it pays at every larger count too (the floats just
    under that call's: the row counts between the probes below it stay on one thread), else never (SHARE_NEVER).
    Returns the floats and the measured ratios, in words.

    >>> choose_sharing(lambda shared, rows: 1.0 if shared and rows >= 11 else 1.2 if shared else 1.1, pairs=3)
    (33791, '3 rows 1.09x, 6 rows 1.09x, 11 rows 0.91x, 22 rows 0.91x, 43 rows 0.91x')
    >>> choose_sharing(lambda shared, rows: 1.0, pairs=3)[0] == SHARE_NEVER
    True
    """
    ratios = {rows: paired_ratio(lambda: timed(True, rows), lambda: timed(False, rows), pairs) for rows in SHARE_ROWS}
    said = ", ".join(f"{rows} rows {ratio:.2f}x" for rows, ratio in ratios.items())
    paying = [rows for rows in SHARE_ROWS if all(ratios[r] <= SHARE_GAIN for r in SHARE_ROWS if r >= rows)]
    return (paying[0] * SHARE_WIDTH - 1 if paying else SHARE_NEVER), said


def _sharing_choice(library_path: Path) -> dict:
    """``choose_sharing`` on this machine, on the threads torch uses, kept beside the built library (so measured
    once per library, CPU and thread count, again when what is tried changes). One thread: nothing to share."""
    threads = torch.get_num_threads()
    if threads < 2:
        return {"floats": SHARE_NEVER, "why": "one thread: nothing to share"}
    set_floats, silu = _OPTIONAL_HERE["tr_small_ops_shared"], _OPTIONAL_HERE["tr_silu_mul_rows"]

    def measure() -> tuple[int, str]:
        gate_up, act = torch.randn(max(SHARE_ROWS), SHARE_WIDTH), torch.empty(max(SHARE_ROWS), SHARE_WIDTH // 2)

        def timed(shared: bool, rows: int) -> float:
            set_floats(0 if shared else SHARE_NEVER)
            t0 = time.perf_counter()
            for _ in range(20):
                silu(gate_up.data_ptr(), rows, SHARE_WIDTH // 2, act.data_ptr(), threads)
            return (time.perf_counter() - t0) * 1e3

        timed(True, max(SHARE_ROWS))  # the first call pays for the threads' start
        floats, said = choose_sharing(timed)
        return floats, f"measured here, SiLU's rows shared among {threads} threads against one: {said}"

    floats, why = _kept(library_path.with_suffix(f".share{threads}"), repr((SHARE_WIDTH, SHARE_ROWS)), measure)
    set_floats(floats)
    return {"floats": floats, "why": why}


def sharing_note() -> str:
    """Past how many floats a call the small operations are shared among the threads here, and why
    (``choose_sharing``), or "" where that is not chosen here."""
    if library() is None or "tr_silu_mul_rows" not in _OPTIONAL_HERE:
        return ""
    floats = _SHARING["floats"]
    said = f"past {floats:,} floats a call" if floats < SHARE_NEVER else "never"
    return f"the norms, rotary embedding and SiLU are shared among the threads {said} ({_SHARING['why']})"


def fetch_note() -> str:
    """What the linear kernels prefetch here and why (``choose_fetch``), or "" without them."""
    if library() is None or "tr_fetch_from_rows" not in _OPTIONAL_HERE:
        return ""
    rows = _FETCH["rows"]
    said = f"from {rows} row{'s' * (rows > 1)}" if rows < NEVER else "never"
    return f"the linear kernels prefetch their weights {said} ({_FETCH['why']})"


def tag() -> str:
    """What the forward's small operations and the C linear layers run on, for cache keys of timings: the C source's
    digest and the linear layers built here (a machine without AVX-512 has none), or "torch"."""
    if library() is None:
        return "torch"
    fetch = f"p{_FETCH['rows']}" if "tr_fetch_from_rows" in _OPTIONAL_HERE else ""
    share = f"s{_SHARING['floats']}" if "tr_silu_mul_rows" in _OPTIONAL_HERE else ""
    return _SOURCE_TAG + "".join(n.removeprefix("tr_").removeprefix("linear_") for n in sorted(_OPTIONAL_HERE)
                                 if n not in UNTIMED) + fetch + share


def status() -> str:
    """One line: whether the native operations run here, and why not where they do not."""
    return "built for this CPU" if library() is not None else (_WHY[-1] if _WHY else "not built")


def _self_check(lib) -> bool:
    """The RMS norm, SiLU and rotary embedding against torch's, to float tolerance (a miscompiled library fails here,
    not in a step; the attention's calls are checked against torch's SDPA by the test suite, the linear layers by
    ``_optional_check``)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 40, generator=g), torch.randn(40, generator=g)
    out = torch.empty_like(x)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    lib.tr_add_rms_norm(x.data_ptr(), None, w.data_ptr(), 1e-5, 3, 40, out.data_ptr())
    gate_up = torch.cat([torch.linspace(-90, 90, 301), torch.randn(301, generator=g)])[None]
    ref_silu = torch.nn.functional.silu(gate_up[:, :301]) * gate_up[:, 301:]
    silu = torch.empty(1, 301)
    lib.tr_silu_mul(gate_up.data_ptr(), 1, 301, silu.data_ptr())
    q, cos, sin = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    ref_q = q * cos + torch.cat([-q[:, 4:], q[:, :4]], -1) * sin
    queries, keys, values = torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8)
    lib.tr_rope_store(q.data_ptr(), q.data_ptr(), q.data_ptr(), 8, cos.data_ptr(), sin.data_ptr(), 2, 1, 1, 8, 1.0,
                      queries.data_ptr(), 2, keys.data_ptr(), values.data_ptr(), 16, 0)
    close = functools.partial(torch.allclose, rtol=1e-5, atol=1e-5)
    return bool(close(out, ref) and close(silu, ref_silu) and close(queries[0], ref_q) and close(keys[0], ref_q)
                and torch.equal(values[0], q))


def _optional_check(name: str, fn, lib) -> bool:
    """A C linear layer against torch's product, on a ragged shape (tails of rows and outputs). ``tr_layers`` has
    no check of its own: it makes the checked calls in the lean forward's order (the suite checks it against that
    forward made call by call, bit for bit)."""
    if name == "tr_amx_ready":
        return bool(fn())
    if name == "tr_attend_amx":
        return "tr_amx_ready" in _OPTIONAL_HERE and _attention_check(fn, lib.tr_attend)
    if name == "tr_silu_mul_rows":
        return "tr_small_ops_shared" in _OPTIONAL_HERE and _sharing_check(fn, lib.tr_silu_mul)
    if name == "tr_top_k":
        return _top_k_check(fn)
    if name not in LINEAR.values():
        return True
    kind = next(d for d, n in LINEAR.items() if n == name)
    if kind == "amx" and "tr_amx_ready" not in _OPTIONAL_HERE:  # checked before it (``OPTIONAL``'s order)
        return False  # the kernel did not grant the tile state: the first tile instruction would kill the process
    dtype = torch.bfloat16 if kind == "amx" else kind
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 37, generator=g), torch.randn(7, 37, generator=g).to(dtype)
    y, tiles = torch.empty(6, 7, dtype=torch.float32), weight_tiles(w, dtype, amx=kind == "amx").tiles
    fn(x.data_ptr(), tiles.data_ptr(), 6, 37, 7, y.data_ptr(), torch.get_num_threads())
    if dtype == torch.bfloat16:  # the products' inputs rounded to bf16, each product exact in fp32
        x = x.to(torch.bfloat16).float()
    return bool(torch.allclose(y, x @ w.float().t(), rtol=1e-5, atol=1e-5))



def _top_k_check(fn) -> bool:
    """``tr_top_k`` against ``torch.topk`` on rows with ties, -infinity and a tail past 16: the same values, and ids
    that hold them, the lowest first among equal ones; and it declines a row with a NaN."""
    x = torch.randint(-40, 40, (5, 1003), generator=torch.Generator().manual_seed(0)).float() / 4  # many ties
    x[1, :990] = -math.inf
    values, ids = torch.empty(5, 9), torch.empty(5, 9, dtype=torch.int64)
    if fn(x.data_ptr(), 5, 1003, 9, values.data_ptr(), ids.data_ptr(), max(2, torch.get_num_threads())):
        return False
    lowest = []  # per row, each value's ids in order: the lowest not yet taken
    for row, got in zip(x.tolist(), values.tolist()):
        after: dict[float, int] = {}
        lowest.append([])
        for w in got:
            at = row.index(w, after.get(w, 0))
            after[w] = at + 1
            lowest[-1].append(at)
    same = torch.equal(values, torch.topk(x, 9).values) and torch.equal(ids, torch.tensor(lowest))
    x[2, 500] = math.nan
    return same and fn(x.data_ptr(), 5, 1003, 9, values.data_ptr(), ids.data_ptr(), 1) == 1


def _sharing_check(fn, silu) -> bool:
    """``tr_silu_mul_rows`` shared among the threads and on one against ``tr_silu_mul`` (checked by ``_self_check``):
    the same bits (each row computed by the same call), on 23 rows, an odd split."""
    set_floats, threads = _OPTIONAL_HERE["tr_small_ops_shared"], max(2, torch.get_num_threads())
    gate_up = torch.randn(23, 2 * 301, generator=torch.Generator().manual_seed(0))
    ref, out = torch.empty(23, 301), torch.empty(23, 301)
    silu(gate_up.data_ptr(), 23, 301, ref.data_ptr())
    same = True
    try:
        for floats in (0, SHARE_NEVER):
            set_floats(floats)
            fn(gate_up.data_ptr(), 23, 301, out.data_ptr(), threads)
            same = same and torch.equal(out, ref)
    finally:
        set_floats(_SHARING["floats"])
    return same


def _attention_check(fn, fp32) -> bool:
    """``tr_attend_amx`` against the fp32 ``tr_attend`` (``fp32``, checked by the suite against torch's SDPA)
    on 2 rows of 9 query heads over 3 kv heads, 128 keys before the window and 2 in it: within bf16's rounding of
    the shared part's inputs."""
    g = torch.Generator().manual_seed(0)
    kv_heads, group, dim, past, n = 3, 3, 64, 129, 2
    keys, values = torch.randn(kv_heads, past + n, dim, generator=g), torch.randn(kv_heads, past + n, dim, generator=g)
    queries = torch.randn(kv_heads, n * group, dim, generator=g) * 0.125
    index = torch.tensor([[128, 129] + [0] * 62, [128, 130] + [0] * 62])
    valid = index > 0
    outs = []
    for attend in (fp32, fn):
        out = torch.empty(n, kv_heads * group * dim)
        attend(queries.data_ptr(), n * group, keys.data_ptr(), values.data_ptr(), keys.stride(0), 128,
               index.data_ptr(), valid.data_ptr(), n, group, kv_heads, dim, out.data_ptr(), torch.get_num_threads())
        outs.append(out)
    return bool(torch.allclose(outs[1], outs[0], rtol=0.05, atol=0.02))
