"""The decoding layer and modules tests/test_decode_varlen.py and tests/test_paged.py share,
each built once per test process (builds are most of those files' time)."""
import functools

import numpy as np

import mhagen

MAX_LEN = 48     # 3 blocks of 16
# head_dim 24: whole vectors and a tail; GQA (2 query heads a K/V head); rotary, ALiBi and a
# window read each row's own positions
LAYER = mhagen.mha(64, 4, head_dim=24, kv_heads=2, causal=True, rotary=True,
                   score_mod=mhagen.alibi(4), mask=mhagen.sliding_window(20), kv_cache=MAX_LEN)
W = LAYER.init_weights(0)


@functools.lru_cache(maxsize=None)
def packed_module():
    """Any number of new tokens, a contiguous KVCache of 4 rows: up to 4 x 3 tokens a call
    (6 query rows a K/V head at most: the template's lanes along head_dim)."""
    return mhagen.build(LAYER, "x86", batch=4, seq_len=None, max_seq_len=3, weights=W,
                        tuning=None)


@functools.lru_cache(maxsize=None)
def paged_module():
    """Any number of new tokens, a paged cache of blocks of 16: up to 4 sequences and 32
    tokens a call (16 query rows a K/V head: rows in the vector lanes)."""
    return mhagen.build(LAYER, "x86", batch=4, seq_len=None, max_seq_len=8, weights=W,
                        tuning=None, kv_block_size=16)


@functools.lru_cache(maxsize=None)
def paged_step_module():
    """One new token for each of 2 sequences of a paged cache (fixed shape)."""
    return mhagen.build(LAYER, "x86", batch=2, seq_len=1, weights=W, tuning=None,
                        kv_block_size=16)


def reference_cache(cache):
    """A float64 copy of a KVCache (the reference's)."""
    return mhagen.KVCache.from_arrays(cache.k.astype(np.float64), cache.v.astype(np.float64),
                                      cache.lens)
