"""LoadBalancer: picks the engine of a data-parallel group for each request - least outstanding work, prefix-cache aware.

Plain Python (no torch): the group tells it when a request starts and ends on an engine, and
it answers which engine the next request should go to.

Work is counted in tokens: a request costs n x (prompt tokens + max new tokens) from the
moment it is routed until it ends. A request whose prompt shares full KV blocks with one an
engine served recently is sent there (that engine likely still holds those blocks in its
prefix cache), unless that engine is clearly more loaded than the least loaded one:

    load[cached] <= (1 + max_prefix_imbalance) * min(load) + cost   ->  the cached engine
    otherwise                                                        ->  the least loaded one
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One chained hash per full block of `token_ids`: hash k covers tokens [0, (k+1) * block_size).

    A partial last block is left out: an engine's prefix cache only reuses full blocks.
    """
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class LoadBalancer:
    """Least outstanding tokens first; a prompt prefix an engine has served pulls the request there.

    `secondary_loads` (e.g. each engine's waiting queue from the coordinator) only breaks ties.
    """

    def __init__(
        self,
        num_engines: int,
        block_size: int,
        max_prefix_imbalance: float = 0.25,
        max_num_prefix_hashes: int = 65536,
    ) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_prefix_imbalance < 0:
            raise ValueError(f"max_prefix_imbalance must be >= 0, got {max_prefix_imbalance}")
        if max_num_prefix_hashes < 1:
            raise ValueError(f"max_num_prefix_hashes must be >= 1, got {max_num_prefix_hashes}")
        self.num_engines = num_engines
        self.block_size = block_size
        self.max_prefix_imbalance = max_prefix_imbalance
        self.max_num_prefix_hashes = max_num_prefix_hashes
        self.outstanding_tokens = [0] * num_engines  # the cost of every request in flight, per engine
        self.num_in_flight = [0] * num_engines
        self.num_routed = [0] * num_engines  # requests routed since the start
        # Block-chain hash -> engines that served a prompt with that prefix; least recently used first.
        self._prefix_owners: OrderedDict[int, set[int]] = OrderedDict()

    @property
    def num_prefix_hashes(self) -> int:
        """Prefix blocks remembered now (at most max_num_prefix_hashes)."""
        return len(self._prefix_owners)

    @staticmethod
    def request_cost(num_prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
        return n * (num_prompt_tokens + max_tokens)

    def pick(
        self,
        prompt_token_ids: Sequence[int] | None,
        cost: int,
        available: Sequence[int] | None = None,
        secondary_loads: Sequence[float] | None = None,
    ) -> int:
        """The engine for a request of `cost` tokens; `available` limits the choice (default: all).

        Does not count the request: call started() with the engine that took it.
        """
        engines = list(range(self.num_engines)) if available is None else list(available)
        if not engines:
            raise ValueError("available: no engine to route to")

        def key(i: int) -> tuple:
            return (self.outstanding_tokens[i], secondary_loads[i] if secondary_loads else 0, i)

        least_loaded = min(engines, key=key)
        if prompt_token_ids:
            bound = (1 + self.max_prefix_imbalance) * self.outstanding_tokens[least_loaded] + cost
            # The deepest shared prefix first: it saves the most prefill.
            for block_hash in reversed(prefix_block_hashes(prompt_token_ids, self.block_size)):
                owners = [i for i in self._prefix_owners.get(block_hash, ()) if i in engines]
                fit = [i for i in owners if self.outstanding_tokens[i] <= bound]
                if fit:
                    return min(fit, key=key)
        return least_loaded

    def started(self, engine: int, cost: int, prompt_token_ids: Sequence[int] | None = None) -> None:
        """Counts a request routed to `engine` and remembers that engine for its prompt's prefix blocks."""
        self.outstanding_tokens[engine] += cost
        self.num_in_flight[engine] += 1
        self.num_routed[engine] += 1
        if prompt_token_ids:
            for block_hash in prefix_block_hashes(prompt_token_ids, self.block_size):
                owners = self._prefix_owners.pop(block_hash, set())
                owners.add(engine)
                self._prefix_owners[block_hash] = owners  # now the most recently used
            while len(self._prefix_owners) > self.max_num_prefix_hashes:
                self._prefix_owners.popitem(last=False)

    def finished(self, engine: int, cost: int) -> None:
        """The request started() on `engine` with `cost` has ended (finished, aborted or failed)."""
        self.outstanding_tokens[engine] -= cost
        self.num_in_flight[engine] -= 1
        assert self.outstanding_tokens[engine] >= 0 and self.num_in_flight[engine] >= 0, "finished() without started()"

    def resize(self, num_engines: int) -> None:
        """Elastic EP: engines are added at the end or removed from the end (a removed one must have nothing in flight)."""
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        if any(self.num_in_flight[num_engines:]):
            raise ValueError(f"resize: engines {num_engines}.. still have requests in flight")
        extra = max(0, num_engines - self.num_engines)
        for counts in (self.outstanding_tokens, self.num_in_flight, self.num_routed):
            del counts[num_engines:]
            counts.extend([0] * extra)
        for owners in self._prefix_owners.values():
            owners.difference_update(range(num_engines, self.num_engines))
        self.num_engines = num_engines

    def forget_engine(self, engine: int) -> None:
        """Drops what is known about `engine`'s prefix cache (it was reset, or its weights changed)."""
        for owners in self._prefix_owners.values():
            owners.discard(engine)

    def forget_prefixes(self) -> None:
        """Drops every remembered prefix (all prefix caches were reset)."""
        self._prefix_owners.clear()
