"""The MLX runtime: the target adapter that records taps and rolls back its KV cache
(`target`), the drafters (`eagle3` chains, `block` DFlash/DSpark, `ngram` prompt lookup) built
from `layers`, the speculative loop (`decode`), draft-length policies (`policy`, `latency`),
sampling, text and stop rules (`sampling`, `generate`), a loaded target+drafter pair
(`session`), and parity with the torch reference (`parity`)."""
