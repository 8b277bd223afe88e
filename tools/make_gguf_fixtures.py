#!/usr/bin/env python3
"""Write the GGUF dequantisation fixtures used by `src/gguf` tests.

Output (committed, ~100 KB in all):
  tests/fixtures/gguf/quants.gguf   one tensor per ggml type, named after the type
  tests/fixtures/gguf/quants.json   for each tensor: ggml type id, numpy (row-major)
                                    shape, and the values `gguf.quants.dequantize`
                                    gives, as float32 printed shortest-round-trip

How the blocks are made (fixed seed, so reruns give the same files):
  * types `gguf.quants.quantize` supports (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0, MXFP4): 2 x 256 values from N(0, 1), quantised by the package;
  * K-quants it cannot quantise (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): 2 blocks of random
    bytes whose f16 scale fields are overwritten with valid positive scales, so every
    bit pattern of the packed quants/sub-scales is exercised without NaN/inf.
Q8_K and Q8_1 are not covered here: the package has no dequantiser for them (Q8_K is
tested in Rust against a scalar loop instead).

Usage: /work/venv-ref/bin/python tools/make_gguf_fixtures.py [out_dir]
Needs: pip install gguf==0.19.0 numpy
"""
import json
import os
import sys

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "gguf")
ROWS, COLS = 2, 256
rng = np.random.default_rng(20261130)


def f16_bytes(values):
    return np.asarray([values], dtype=np.float16).view(np.uint8)


def random_kquant(qtype):
    """Two random blocks with sane f16 scales at the offsets ggml-common.h defines."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = ROWS * COLS // 256
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    # (offset of d, offset of dmin or None) inside each block
    scale_offsets = {
        T.Q2_K: (80, 82),   # scales[16] qs[64] d dmin
        T.Q3_K: (108, None),  # hmask[32] qs[64] scales[12] d
        T.Q4_K: (0, 2),     # d dmin scales[12] qs[128]
        T.Q5_K: (0, 2),     # d dmin scales[12] qh[32] qs[128]
        T.Q6_K: (208, None),  # ql[128] qh[64] scales[16] d
    }[qtype]
    for b in range(n_blocks):
        d_off, m_off = scale_offsets
        raw[b, d_off:d_off + 2] = f16_bytes(rng.uniform(0.001, 0.05))
        if m_off is not None:
            raw[b, m_off:m_off + 2] = f16_bytes(rng.uniform(0.001, 0.05))
    return raw.reshape(ROWS, -1)


def main():
    os.makedirs(OUT, exist_ok=True)
    w = GGUFWriter(os.path.join(OUT, "quants.gguf"), arch="fixture")
    w.add_name("caracal gguf dequantisation fixtures")
    w.add_uint32("fixture.rows", ROWS)
    w.add_uint32("fixture.cols", COLS)
    ref = {"generator": "tools/make_gguf_fixtures.py with gguf 0.19.0", "tensors": {}}

    normal = lambda: rng.standard_normal((ROWS, COLS)).astype(np.float32)
    plain = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4]
    kquants = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
    for qtype in plain + kquants:
        if qtype in plain:
            x = normal()
            if qtype == T.F32:
                # a 3-D tensor, so the reader's dims/shape handling is exercised
                x = x.reshape(2, 2, COLS // 2)
            data = quantize(x, qtype)
        else:
            data = random_kquant(qtype)
        name = qtype.name.lower()
        if qtype in (T.F32, T.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
        values = dequantize(data, qtype).astype(np.float32)
        if qtype == T.F32:
            shape = list(values.shape)
        else:
            shape = [ROWS, COLS]
        ref["tensors"][name] = {
            "ggml_type": int(qtype),
            "shape": shape,
            "values": [float(str(v)) if np.isfinite(v) else None for v in values.ravel()],
        }

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(os.path.join(OUT, "quants.json"), "w") as f:
        # str(np.float32) is the shortest decimal that round-trips the float32
        json.dump(ref, f, separators=(",", ":"))
        f.write("\n")
    for fn in ("quants.gguf", "quants.json"):
        print(fn, os.path.getsize(os.path.join(OUT, fn)), "bytes")


if __name__ == "__main__":
    main()
