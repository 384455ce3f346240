"""The vocabulary that the reuse layer and every store share, below both of them.

- `handles`: where a chunk's values live (`Tier`), its KV blob (`BlobHandle`, the publication bit)
  and latent skeleton (`Skeleton`), and the three node fields a store reads (`ChunkNode`);
- `locators`: the store keys of a chunk's values, derived from its node key;
- `payload`: a chunk's KV in bytes (`LayerPayload`, `payload_nbytes`) and where a whole-path
  restore lands (`RestoreTarget`);
- `ring`: the runtime's ring geometry and the copy runs of a restore (`RingGeometry`, `CopyRun`).

Torch-free; imports only `cacheseek.errors`.
"""
