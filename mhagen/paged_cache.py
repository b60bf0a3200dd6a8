"""PagedKVCache: a decoding layer's K/V cache as a pool of fixed-size blocks shared by many
sequences (vLLM's PagedAttention block manager; FlashInfer's paged KV layout).

    k, v    [num_blocks, kv_heads, block_size, head_dim]  (FlashInfer's "HND" layout: a
            block of one K/V head is a contiguous [block_size, head_dim] tile, the unit the
            decode template reads a key block from), 64-byte aligned, the cache dtype
    a sequence: an id (int), its length and its block table (the pool blocks holding its
            tokens 0..len-1 in order: token p in block table[p // block_size], row
            p % block_size)

Blocks are reference counted: `fork(seq)` makes a sequence that shares every block of seq
(beams, parallel samples of one prompt: no copy); a block is copied when a sequence is
about to write into it while another holds it too (copy-on-write: at the first diverging
block, the partly filled last one, or any later block a truncated sequence rewrites).
`free(seq)` returns the blocks no other sequence holds. A module call (built with
kv_block_size=) first `reserve`s room for each row's new tokens (copies and new blocks,
all or nothing: a pool without enough free blocks is refused before anything is written),
then its kernels write the new K/V rows into those blocks, then the lengths advance.
"""
from __future__ import annotations

import numpy as np

from mhagen.arrays import aligned_zeros
from mhagen.checks import positive_int
from mhagen.dtypes import numpy_dtype
from mhagen.errors import InputError
from mhagen.kvcache import KVCache, cache_shape
from mhagen.runtime import tensor


class PagedKVCache:
    """A pool of num_blocks blocks of block_size tokens for sequences of up to max_len
    tokens (see the module docstring). dtype: what the blocks store (float32; a half
    dtype for a layer built with cache_dtype=; float64 for the reference)."""

    def __init__(self, num_blocks: int, block_size: int, *, kv_heads: int, head_dim: int,
                 max_len: int, dtype=np.float32):
        num_blocks, block_size = (positive_int(n, v, InputError) for n, v in
                                  (("num_blocks", num_blocks), ("block_size", block_size)))
        shape = (num_blocks, positive_int("kv_heads", kv_heads, InputError), block_size,
                 positive_int("head_dim", head_dim, InputError))
        self.max_len = positive_int("max_len", max_len, InputError)
        self.block_size = block_size
        self.k, self.v = aligned_zeros(shape, dtype), aligned_zeros(shape, dtype)
        self._refs = [0] * num_blocks      # sequences holding each block
        self._free = list(range(num_blocks - 1, -1, -1))   # pop() gives the lowest first
        self._tables: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_id = 0
        self._tensors = None

    @classmethod
    def for_module(cls, layer, num_blocks: int, block_size: int | None = None,
                   dtype=None) -> "PagedKVCache":
        """A pool for `layer` (a Module built with kv_block_size=, whose block size it takes,
        or a decoding graph, for the reference: then give block_size); dtype: default what
        the layer's cache stores (np.float64 for a reference pool)."""
        graph = getattr(layer, "graph", layer)
        spec = cache_shape(graph)
        if spec is None:
            raise InputError(f"layer {graph.name!r} keeps no K/V cache; build it with "
                             "mhagen.mha(..., kv_cache=max_len)")
        built = getattr(layer, "kv_block_size", None)
        if block_size is None and built is None:
            raise InputError("give block_size= (tokens a block): a layer does not say it, a "
                             "module built with kv_block_size= does")
        if block_size is not None and built is not None and block_size != built:
            raise InputError(f"this module reads blocks of {built} tokens (built with "
                             f"kv_block_size={built}); block_size={block_size} differs")
        dtype = numpy_dtype(spec["dtype"]) if dtype is None else dtype
        return cls(num_blocks, block_size or built, kv_heads=spec["kv_heads"],
                   head_dim=spec["head_dim"], max_len=spec["max_len"], dtype=dtype)

    # -- the pool -------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def max_blocks(self) -> int:
        """Blocks of one sequence at max_len tokens: a block table's width."""
        return -(-self.max_len // self.block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def sequences(self) -> list:
        """The ids of the sequences held, in the order they were made."""
        return list(self._tables)

    def refcount(self, block: int) -> int:
        """How many sequences hold `block`."""
        return int(self._refs[block])

    def tensors(self):
        """TVM tensors over k and v (what a module call passes its kernels), made once."""
        held = self._tensors
        if held is None or held[0] is not self.k or held[1] is not self.v:
            held = self._tensors = (self.k, self.v, tensor(self.k), tensor(self.v))
        return held[2], held[3]

    # -- sequences ------------------------------------------------------------------------
    def add(self) -> int:
        """A new empty sequence; its id (no block is taken until it gets tokens)."""
        seq = self._next_id
        self._next_id += 1
        self._tables[seq], self._lens[seq] = [], 0
        return seq

    def fork(self, seq: int) -> int:
        """A new sequence with seq's tokens, sharing its blocks (each block's count goes
        up; the first write into a shared block copies it); its id."""
        table = self._table(seq)
        child = self.add()
        self._tables[child] = list(table)
        self._lens[child] = self._lens[seq]
        for block in table:
            self._refs[block] += 1
        return child

    def free(self, seq: int) -> None:
        """Drop sequence seq: its blocks go back to the pool where no other sequence holds
        them."""
        for block in self._table(seq):
            self._release(block)
        del self._tables[seq], self._lens[seq]

    def truncate(self, seq: int, length: int) -> None:
        """Keep seq's first `length` tokens (rejected speculative tokens, a rewound beam):
        blocks past them are released; later tokens are written from there."""
        held = self._lens[self._check_seq(seq)]
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) \
                or not 0 <= length <= held:
            raise InputError(f"truncate: sequence {seq} holds {held} tokens; length must "
                             f"be in 0..{held}, got {length!r}")
        keep = -(-int(length) // self.block_size)
        for block in self._tables[seq][keep:]:
            self._release(block)
        del self._tables[seq][keep:]
        self._lens[seq] = int(length)

    def lens(self, seq: int) -> int:
        """Tokens sequence seq holds."""
        return self._lens[self._check_seq(seq)]

    def blocks(self, seq: int) -> list:
        """Sequence seq's block table (a copy): the blocks of its tokens, in order."""
        return list(self._table(seq))

    def reserve(self, seqs, counts) -> None:
        """Make room for counts[i] more tokens in sequence seqs[i]: a new block where the
        tokens run past the last one, a copy of each shared block they will write into
        (copy-on-write). All or nothing: InputError, and nothing changed, where a sequence
        is unknown or given twice, would pass max_len, or the pool lacks free blocks.
        A module call does this before its kernels write."""
        seqs, counts = [int(s) for s in seqs], [int(n) for n in counts]
        if len(set(seqs)) != len(seqs):
            raise InputError(f"seqs lists a sequence twice ({seqs}): a call writes each "
                             "sequence's tokens once")
        plan, need = [], 0      # (table, its shared blocks to copy, blocks to add)
        for seq, n in zip(seqs, counts):
            held = self._lens[self._check_seq(seq)]
            if n < 0 or held + n > self.max_len:
                raise InputError(f"sequence {seq} holds {held} tokens; {n} new ones need "
                                 f"at most {self.max_len} in all (max_len): free or "
                                 "truncate it, or build with a larger kv_cache=")
            copies, new = self._copies(seq, n), self._new_blocks(seq, n)
            if copies or new:
                plan.append((self._tables[seq], copies, new))
                need += len(copies) + new
        if need > len(self._free):
            raise InputError(f"the paged K/V cache has {len(self._free)} free blocks of "
                             f"{self.num_blocks}; this call needs {need} (new tokens "
                             f"{dict(zip(seqs, counts))}): free finished sequences "
                             "(cache.free(seq)) or make a larger pool")
        for table, copies, new in plan:
            for i in copies:
                old, block = table[i], self._take()
                self.k[block], self.v[block] = self.k[old], self.v[old]
                self._release(old)
                table[i] = block
            table += [self._take() for _ in range(new)]

    def advance(self, seqs, counts) -> None:
        """Add counts[i] to sequence seqs[i]'s length (after a call wrote its tokens into
        the blocks reserve() made room in)."""
        for seq, n in zip(seqs, counts):
            self._lens[int(seq)] += int(n)

    def gather(self, seqs, lens, tables) -> None:
        """Write the lengths of sequences seqs into lens[:len(seqs)] and their block tables
        into the rows of tables ([rows, max_blocks] int32; entries past a sequence's blocks
        are left as they are): what a module call passes its kernels."""
        for row, seq in enumerate(seqs):
            blocks = self._tables[seq]
            lens[row] = self._lens[seq]
            tables[row, :len(blocks)] = blocks

    def to_contiguous(self, seqs, dtype=None) -> KVCache:
        """A KVCache holding sequences `seqs` as its rows (max_len tokens each; rows past a
        sequence's length are zero), e.g. to compare with a contiguous cache."""
        shape = (len(seqs), self.kv_heads, self.max_len, self.head_dim)
        dtype = self.k.dtype if dtype is None else dtype
        k, v = aligned_zeros(shape, dtype), aligned_zeros(shape, dtype)
        for row, seq in enumerate(seqs):
            held = self.lens(seq)
            for i, block in enumerate(self._tables[seq][:-(-held // self.block_size)]):
                lo, hi = i * self.block_size, min(held, (i + 1) * self.block_size)
                k[row, :, lo:hi] = self.k[block, :, :hi - lo]
                v[row, :, lo:hi] = self.v[block, :, :hi - lo]
        return KVCache(k, v, np.array([self.lens(s) for s in seqs], np.int32))

    def write(self, seq: int, start: int, k_rows, v_rows) -> None:
        """Write k_rows, v_rows [kv_heads, n, head_dim] at positions start .. start + n - 1
        of sequence seq, whose blocks must hold them (reserve() made room): what a module
        call's kernels do, for the reference and for tests."""
        table = self._table(seq)
        for t in range(np.shape(k_rows)[1]):
            pos = start + t
            block, row = table[pos // self.block_size], pos % self.block_size
            self.k[block, :, row] = k_rows[:, t]
            self.v[block, :, row] = v_rows[:, t]

    def check(self) -> None:
        """Raise AssertionError unless the pool is consistent: every block's count is the
        number of sequences holding it, the free blocks are exactly those nobody holds,
        and every sequence has the blocks of its tokens (for tests)."""
        refs = [0] * self.num_blocks
        for seq, table in self._tables.items():
            assert len(table) == -(-self._lens[seq] // self.block_size), (seq, table)
            for block in table:
                refs[block] += 1
        assert refs == self._refs, (refs, self._refs)
        assert sorted(self._free) == [b for b in range(self.num_blocks) if refs[b] == 0]

    def __repr__(self):
        return (f"<mhagen.PagedKVCache {self.num_blocks} blocks of {self.block_size} "
                f"({self.free_blocks} free), {len(self._tables)} sequences, max_len "
                f"{self.max_len}, {self.k.dtype}>")

    # -- internals ------------------------------------------------------------------------
    def _check_seq(self, seq) -> int:
        if seq in self._tables and type(seq) is int:
            return seq
        if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) \
                or int(seq) not in self._tables:
            raise InputError(f"{seq!r} is not a sequence of this paged cache (its ids: "
                             f"{self.sequences[:16]}); make one with cache.add()")
        return int(seq)

    def _table(self, seq) -> list:
        return self._tables[self._check_seq(seq)]

    def _copies(self, seq, n) -> list:
        """Indices in seq's table of the shared blocks n new tokens would write into."""
        if n == 0:
            return []
        table, held, refs = self._tables[seq], self._lens[seq], self._refs
        first, last = held // self.block_size, (held + n - 1) // self.block_size
        return [i for i in range(first, min(last + 1, len(table))) if refs[table[i]] > 1]

    def _new_blocks(self, seq, n) -> int:
        """Blocks seq needs beyond its table to hold n more tokens."""
        return max(0, -(-(self._lens[seq] + n) // self.block_size) - len(self._tables[seq]))

    def _take(self) -> int:
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def _release(self, block) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)
