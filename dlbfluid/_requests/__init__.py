"""The request-level twin of the fluid model: a batched stochastic simulation of the same
scenarios, request by request (theory/requests.md).

Requests arrive at the root routers as time-varying Poisson processes, are routed by the
fluid simulator's own policy objects from delayed, probed request counts, travel to their
cell, are served there (`markov`: the density-dependent birth-death process whose fluid
limit is the fluid model; `servers`: the App.-B prefill/decode servers of a cell's
`servers` object, or exponential FIFO servers for an M/M/1 cell), and come back. The event
loop is exact (competing exponentials with thinning for the arrivals), runs inside
`lax.while_loop` per probe tick and is vmapped over scenarios x trials.
"""

from .cells import AbstractCells as AbstractCells
from .histogram import LatencyHistogram as LatencyHistogram
from .markov import MarkovCells as MarkovCells
from .prefill_decode import PrefillDecodeCells as PrefillDecodeCells
from .servers import FifoServers as FifoServers
from .simulate import REQUEST_STATUS as REQUEST_STATUS
from .simulate import simulate_requests as simulate_requests
from .solution import RequestSolution as RequestSolution
