"""The vocabulary that the reuse layer and every store share, below both of them.

- `handles`: where a chunk's values live (`Tier`), its KV blob (`BlobHandle`, the publication bit)
  and latent skeleton (`Skeleton`), and the three node fields a store reads (`ChunkNode`);
- `locators`: the store keys of a chunk's values, derived from its node key;
- `payload`: a chunk's KV in bytes (`LayerPayload`, `payload_nbytes`) and where a whole-path
  restore lands (`RestoreTarget`);
- `ring`: the runtime's ring geometry and the copy runs of a restore (`RingGeometry`, `CopyRun`);
- `records`, `claims`: how any process finds a chunk in a shared store by its key alone, and
  marks one it is computing;
- the values kept beside a chunk, each bound to its key and checked: `frames`, `decoder_state`
  (with `runtime_decoder`, a runtime's decoder as the binding sees it) and `encode` (a session's
  prompt and condition encodes).

The first four are torch-free (of the package they import only `cacheseek.errors` and each other);
the value formats use torch.
"""
