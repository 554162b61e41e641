"""The decode-graph bookkeeping on its own: which sizes are captured, and how a batch is
padded to one of them (the kernel then skips requests with no rows)."""
from __future__ import annotations

import numpy as np

from orca_backend.runner.cuda_graphs import capture_sizes
from orca_backend.runner.models.attention import BatchLayout
from orca_backend.runner.models.kernel_attention import kernel_metadata


def test_capture_sizes_cover_every_batch_up_to_the_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(256)[-3:] == [224, 240, 256] and len(capture_sizes(256)) == 20


def test_kernel_metadata_for_a_mixed_batch():
    layout = BatchLayout(num_computed_tokens=[5, 0, 17], num_scheduled_tokens=[1, 3, 2],
                         block_tables=[[4], [2, 9], [7, 1]])
    positions, cu_seqlens_q, seq_lens, block_tables = kernel_metadata(layout)
    assert positions.tolist() == [5, 0, 1, 2, 17, 18]
    assert cu_seqlens_q.tolist() == [0, 1, 4, 6]
    assert seq_lens.tolist() == [6, 3, 19]
    assert block_tables.tolist() == [[4, 0], [2, 9], [7, 1]]
    assert all(a.dtype == np.int32 for a in (positions, cu_seqlens_q, seq_lens, block_tables))


def test_padding_adds_requests_with_no_rows_and_no_kv():
    layout = BatchLayout(num_computed_tokens=[3, 8, 0], num_scheduled_tokens=[1, 1, 1],
                         block_tables=[[4], [2], [6]])
    positions, cu_seqlens_q, seq_lens, block_tables = kernel_metadata(layout, num_rows=4, num_requests=4)
    assert positions.tolist() == [3, 8, 0, 0]
    assert cu_seqlens_q.tolist() == [0, 1, 2, 3, 3]
    assert seq_lens.tolist() == [4, 9, 1, 0]
    assert block_tables.shape == (4, 1)
