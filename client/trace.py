"""The load generator's traces: `orca_backend.simulate.workload`, which the simulator replays too."""
from orca_backend.simulate.workload import (  # noqa: F401
    CORPUS,
    ORCA_INPUT,
    ORCA_OUTPUT,
    LOGNORMAL_CAPS,
    LengthDist,
    TraceRequest,
    SharedPrefixes,
    load_tokenizer,
    corpus_text,
    poisson_offsets,
    make_trace,
    exact_rate,
    add_trace_arguments,
    trace_from_arguments,
)
