"""The request-level twin of the fluid model: a batched stochastic simulation of the same
scenarios, request by request (theory/requests.md).

Requests arrive at the root routers as time-varying Poisson processes, are routed by the
fluid simulator's own policy objects from delayed, probed request counts, travel to their
cell, are served there (`markov`: the density-dependent birth-death process whose fluid
limit is the fluid model; `servers`: the App.-B prefill/decode servers of a cell's
`servers` object, or exponential FIFO servers for an M/M/1 cell), and come back. Both are
exact: `markov` cells run an event loop (competing exponentials with thinning for the
arrivals) inside `lax.while_loop` per probe tick; `servers` cells fix each request's
completion when it is admitted (`admission`: Lindley and Kiefer-Wolfowitz recursions), so
that a tick is a block whose cost follows its requests. Both are vmapped over scenarios x
trials.
"""

from .cells import AbstractCells as AbstractCells
from .fifo import FifoCells as FifoCells
from .histogram import LatencyHistogram as LatencyHistogram
from .markov import MarkovCells as MarkovCells
from .simulate import REQUEST_STATUS as REQUEST_STATUS
from .simulate import simulate_requests as simulate_requests
from .solution import RequestSolution as RequestSolution
