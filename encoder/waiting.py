"""Which waiting request takes a free slot: the one rule the proxy's pool and vLLM's queue share.

In order:
1. fairness: a request that has waited `max_wait` goes first, the longest-waiting first;
2. a request without a predicted profile keeps first-come-first-served: when it is the oldest
   waiting request it goes, and no request that arrived after it is chosen before it;
3. with nobody resident (who has a profile), the oldest: there is nothing to fit yet;
4. else, among the requests that arrived before the first profile-less one (and whose profile
   has the oldest one's size), the one the resident set picks: with predicted profiles
   (`encoder.admission.ResidentExperts`) the fewest expected new experts per step; with
   embeddings only (`ResidentEmbedding`) the nearest to the resident set. Ties go to the
   earliest arrival.

Pure numpy; callers keep their waiting requests in arrival order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from encoder.admission import ResidentEmbedding, ResidentExperts, oldest_overdue


Resident = ResidentExperts | ResidentEmbedding


def resident_size(resident: Resident | None) -> int | None:
    """Length of the vectors `resident` holds ([L*E] profiles or [D] embeddings); None for None."""
    if resident is None:
        return None
    return int(np.prod(resident.shape)) if isinstance(resident, ResidentExperts) else len(resident.total)


def next_to_admit(waited: Sequence[float], profiles: Sequence[np.ndarray | None],
                  resident: Resident | None, max_wait: float | None) -> int:
    """Index of the request to admit among `profiles` (flat [L*E] or None each), in arrival order.

    `waited[i]` is how long request i has waited (same unit as `max_wait`); `resident` holds the
    resident requests' profiles, of the oldest waiting request's size (None: nobody resident has one).
    """
    if not len(profiles):
        raise ValueError("no waiting request to admit")
    overdue = oldest_overdue(np.asarray(waited, dtype=np.float64), max_wait)
    if overdue is not None:
        return overdue
    plain = next((i for i, p in enumerate(profiles) if p is None), len(profiles))
    if plain == 0 or resident is None or resident.count == 0:
        return 0
    size = profiles[0].shape[0]
    if resident_size(resident) != size:
        raise ValueError(f"the resident set holds vectors of {resident_size(resident)}, the oldest request {size}")
    eligible = [i for i in range(plain) if profiles[i].shape[0] == size]
    return eligible[resident.pick(np.stack([profiles[i] for i in eligible]))]  # [n, L*E]
