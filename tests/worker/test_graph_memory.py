"""The cache budget's allowance for CUDA graphs: block tables, logits and activations of the largest
decode (and verify) graph; none on a rank that captures no graphs."""

from __future__ import annotations

from deltaserve.worker.verify_graph import graph_memory_bytes


def test_graph_memory_counts_the_largest_size_of_each_kind():
    # 1M context in blocks of 16: 65,536 int64 entries per block-table row; 163,840 float32 logits per row
    per_row = 65_536 * 8 + 163_840 * 4 + 1000
    decode = graph_memory_bytes(256, 1 << 20, 16, 163_840, 1000)
    assert decode == 256 * per_row
    # k = 3: windows of 4 tokens, at most 512 rows (128 windows); the verify logits have a static copy too
    assert graph_memory_bytes(256, 1 << 20, 16, 163_840, 1000, window=4) == decode + 512 * (per_row + 163_840 * 4)
    # a few sequences: the sizes stop at max_num_seqs
    assert graph_memory_bytes(3, 4096, 16, 512, 0, window=2) == 3 * (256 * 8 + 512 * 4) + 6 * (256 * 8 + 2 * 512 * 4)


def test_a_cpu_rank_sets_nothing_aside_for_graphs():
    from deltaserve import LLM

    llm = LLM(model="random:tiny", device="cpu", dtype="float32", num_kv_blocks=16)
    try:
        assert llm.llm_engine.executor.worker.graph_memory_bytes() == 0
    finally:
        llm.llm_engine.shutdown()
