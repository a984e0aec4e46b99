"""The cross-site all-reduce: a weighted average of a flat float32 tensor over sites.

One engine per rank (per lane) exchanges its share of the vector with its
counterparts in the other sites, chunk by chunk: encoded on a worker thread,
sent on gRPC streams, verified, decoded and reduced as they arrive. Every
site ends with bitwise-identical output, whatever the codec: every result is
encoded once, by its owner, and every site decodes those same bytes (with
gather, every site encodes the same bits alike).

By topic:

- :mod:`.engine`: :class:`CrossSiteAllReduce`, the peer lifecycle and the
  bookkeeping of rounds; it checks a round's arguments and picks the algorithm;
- :mod:`.direct`: the direct algorithm (every site owns a slice; full mesh);
- :mod:`.gather`: every site sends everything to every site and reduces it
  itself (one trip of the longest link; direct's result);
- :mod:`.ring`: the ring (each site talks to its successor only);
- :mod:`.incoming`: the buffers that peers' chunks arrive into, and which
  rounds' chunks are kept;
- :mod:`.sending`: encoding, reliable delivery, sends that outlive their round;
- :mod:`.feedback`: error-feedback residuals for lossy codecs;
- :mod:`.rounds`: what the algorithms share (a round's plan, stats, error);
- :mod:`.faults`: faults for tests, passed in as a chunk filter.
"""

from isthmus.inter.allreduce.corruption import CorruptPayloads
from isthmus.inter.allreduce.engine import FLUSH_ON_CLOSE_S, LENIENT_HELLO_S, CrossSiteAllReduce
from isthmus.inter.allreduce.incoming import MAX_ROUNDS_AHEAD, Inbox, Incoming
from isthmus.inter.allreduce.rounds import RoundError, RoundStats, all_finite, slice_bounds
from isthmus.inter.allreduce.sending import ChunkFilter

__all__ = [
    "FLUSH_ON_CLOSE_S",
    "LENIENT_HELLO_S",
    "MAX_ROUNDS_AHEAD",
    "ChunkFilter",
    "CorruptPayloads",
    "CrossSiteAllReduce",
    "Inbox",
    "Incoming",
    "RoundError",
    "RoundStats",
    "all_finite",
    "slice_bounds",
]
