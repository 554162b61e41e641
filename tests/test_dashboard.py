"""The Grafana dashboard (docs/grafana/orca-dashboard.json): every series its queries select is
one the serving model declares (metric_table.py), of the right kind for how it is used, grouped
by labels it has; and a real tritonserver's /metrics has each of them once it has served."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from client.triton_client import StreamingClient
from orca_backend.serving.metric_table import ROWS, Kind

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "orca-dashboard.json"
_SUFFIXES = ("_bucket", "_sum", "_count")


def queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def selected(expr: str) -> list[str]:
    """The series a query selects: every name written before a {label matcher}."""
    return re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", expr)


def _row(name: str):
    rows = {row.name: row for row in ROWS}
    if name in rows:
        return rows[name], None
    base = next((name[:-len(s)] for s in _SUFFIXES if name.endswith(s)), None)
    return rows.get(base), base


def test_every_query_selects_declared_series_grouped_by_their_labels():
    exprs = queries()
    assert len(exprs) >= 20
    for expr in exprs:
        names = selected(expr)
        assert names, expr
        for name in names:
            row, base = _row(name)
            assert row is not None, f"{name} (in {expr}) is not a series the model exports"
            if base is not None:
                assert row.kind is Kind.HISTOGRAM, f"{name}: {base} is not a histogram"
            rated = name in re.findall(r"(?:rate|increase)\(([a-zA-Z_:][a-zA-Z0-9_:]*)\{", expr)
            assert rated == (row.kind is not Kind.GAUGE), f"{expr}: a rate of a gauge, or a counter read as it is"
            labels = {row.by, *(key for key, _ in row.labels)} | ({"le"} if base else set())
            for group in re.findall(r"by \(([^)]*)\)", expr):
                for label in (g.strip() for g in group.split(",")):
                    assert label in labels, f"{expr} groups by {label!r}, which {name} has not"


@pytest.mark.server
def test_a_served_model_exports_every_series_the_dashboard_selects(server):
    with StreamingClient(server.grpc_url) as c:
        assert c.generate("Hello", sampling={"max_tokens": 3}).error is None
    exported = {key.split("{")[0] for key in server.metrics()}
    for expr in queries():
        for name in selected(expr):
            row, _ = _row(name)
            if row.lazy or row.by:  # made on first sight of a value: speculation, adapters, refusal reasons
                continue
            assert name in exported, f"{name} (in {expr}) is not on /metrics"
