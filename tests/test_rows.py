"""psctl.runtime.rows: the fast row gather/scatter and unique ids give exactly what numpy's own forms give."""

from __future__ import annotations

import numpy as np
import pytest

from psctl.runtime.rows import gather_rows, scatter_rows, unique_ids


@pytest.mark.parametrize("shape", [(50, 4), (50, 3, 2), (50,)])
def test_gather_and_scatter_match_fancy_indexing(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    table = rng.standard_normal(shape).astype(np.float32)
    ids = np.array([7, 0, 49, 13], dtype=np.int64)
    assert np.array_equal(gather_rows(table, ids), table[ids])
    values = rng.standard_normal((len(ids), *shape[1:])).astype(np.float32)
    expected = table.copy()
    expected[ids] = values
    scatter_rows(table, ids, values)
    assert np.array_equal(table, expected)


def test_scatter_falls_back_for_other_dtypes_views_and_empty_ids() -> None:
    table = np.zeros((6, 4), dtype=np.float32)
    scatter_rows(table, np.array([1]), np.ones((1, 4), dtype=np.float64))  # cast, as table[ids] = values does
    assert table[1].tolist() == [1, 1, 1, 1] and table.sum() == 4
    column_view = np.zeros((6, 8), dtype=np.float32)[:, ::2]  # not contiguous: the view trick cannot apply
    scatter_rows(column_view, np.array([5]), np.full((1, 4), 2, dtype=np.float32))
    assert column_view[5].tolist() == [2, 2, 2, 2] and column_view.sum() == 8
    scatter_rows(table, np.zeros(0, dtype=np.int64), np.zeros((0, 4), dtype=np.float32))
    assert table.sum() == 4


@pytest.mark.parametrize("ids", [np.zeros(0, dtype=np.int64), np.array([3]), np.array([[5, 1, 5], [9, 1, 0]])])
def test_unique_ids_matches_numpy(ids: np.ndarray) -> None:
    unique, inverse = unique_ids(ids, return_inverse=True)
    assert np.array_equal(unique, np.unique(ids))
    assert np.array_equal(unique[inverse], ids.reshape(-1))
    assert np.array_equal(unique_ids(ids), np.unique(ids))
