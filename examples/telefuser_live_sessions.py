"""CacheSeek wired into TeleFuser's LingBot-World-fast, the way its services run live sessions.

Runs as written on the installed TeleFuser (the PyPI release ``telefuser==0.1.0.post3``, or a
source checkout of TeleFuser main first on ``PYTHONPATH``), on the CPU, with TeleFuser's real
pipeline at a tiny size and random weights (`build_tiny_pipeline`; a real deployment calls
``pipeline.init(...)`` with its checkpoints instead).

Three live sessions from one image and prompt, each streaming one camera control per chunk:
A streams actions X, B the first two of X and then its own, C repeats X. Every chunk is keyed by
the control it ran with, so B shares A's first two chunks in the cache and branches after them,
and no session ever gets another's frames. The last lines say what each session reused: B
restores A's first two chunks and computes its own two; C streams exactly A's controls, so each
of its chunks is restored from A's as its control arrives (a live session knows no control
ahead, so it restores chunk by chunk, never all at once) and C computes no chunk.

    python examples/telefuser_live_sessions.py
"""

from __future__ import annotations

from cacheseek.integrations.telefuser import TeleFuserLayout, attach
from cacheseek.integrations.telefuser.tiny import build_tiny_pipeline
from cacheseek.reuse.exact_prefix import InMemoryTierStore, NamespaceForest, WorldKVManager
from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding, make_rolling_config
from cacheseek.runtime.telefuser import camera_path

L, S, CHUNK = 7, 3, 3  # the ring: 7 latent frames, 3 of them a pinned sink; 3 frames a chunk
WIDTH = HEIGHT = 64
X = [[0.3, -0.2, 0.1], [-0.5, 0.4, 0.0], [0.1, 0.1, -0.3], [0.7, -0.6, 0.2]]
B = X[:2] + [[-0.7, 0.6, 0.2], [0.2, 0.2, 0.2]]

# once per process: the pipeline, CacheSeek attached right after init(), one store and trie
pipeline = build_tiny_pipeline(local_attn_size=L, sink_size=S, height=HEIGHT, width=WIDTH)
layout = attach(pipeline)  # hooks this pipeline instance; weights fingerprinted on first use
store = InMemoryTierStore()
forest = NamespaceForest()
manager = WorldKVManager(forest, store, make_rolling_config(local_attn_size=L, sink_size=S, chunk_size=CHUNK))


def session_config(n_chunks: int, binding: LingBotWorldKVBinding):
    """A live session's config: image, prompt and seed, no camera poses (they stream in)."""
    from PIL import Image
    from telefuser.pipelines.lingbot_world_fast.session import LingBotWorldFastSessionConfig

    image = Image.new("RGB", (WIDTH, HEIGHT), (90, 140, 200))
    config = LingBotWorldFastSessionConfig(prompt="a red car on a coast road", image=image, control_mode="cam",
                                           chunk_size=CHUNK, frame_num=4 * (n_chunks * CHUNK - 1) + 1, seed=42)
    config.world_kv_binding = binding
    return config


def chunk_poses(actions, k):
    """The camera poses of chunk k's latent frames, as a client sends them."""
    poses, intrinsics = camera_path(actions, chunk_size=CHUNK, width=WIDTH, height=HEIGHT)
    latent_poses = poses[::4]
    return {"poses": latent_poses[k * CHUNK:(k + 1) * CHUNK], "intrinsics": intrinsics[0]}


def live_session(actions) -> LingBotWorldKVBinding:
    binding = LingBotWorldKVBinding(manager, forest)  # one per session
    config = session_config(len(actions), binding)
    if layout is TeleFuserLayout.MAIN:  # main: a session, then one submitted control per chunk
        from telefuser.pipelines.lingbot_world_fast.control import LingBotWorldFastControlBuilder

        session = pipeline._create_initialized_session(config)
        streaming = pipeline._get_streaming_runtime()
        handle = streaming.create_session(session)
        builder = LingBotWorldFastControlBuilder(pipeline.control_context(config))
        for k in range(len(actions)):
            action = chunk_poses(actions, k)
            if k:
                action["previous_pose"] = chunk_poses(actions, k - 1)["poses"][-1]
            streaming.submit_chunk(handle, k, builder.build(action))
            while not streaming.poll_frames(handle):
                streaming.wait_until_idle(handle, timeout=0.05)
        streaming.close_session(handle)
    else:  # the release and the hooked commit: an override per chunk
        runtime = pipeline.create_runtime(config)
        for k in range(len(actions)):
            override = pipeline.build_control_override(runtime, chunk_poses(actions, k))
            pipeline.generate_next_chunk(runtime, control_override=override)
    store.flush()
    return binding


if __name__ == "__main__":
    a, b, c = live_session(X), live_session(B), live_session(X)
    shared = sum(x == y for x, y in zip(list(a.actions), list(b.actions)))
    m = manager.metrics
    print(f"TeleFuser layout: {layout.value}")
    print(f"A and B share {shared} of {len(X)} chunk keys; chunks written: {m.writes}; "
          f"chunks not cached (unkeyed): {m.chunks_unkeyed}; hook failures: {m.hook_failures}")
    print(f"the trie holds {len(forest.resolve(a.root).root.children)} branch(es) at chunk 0")
    for name, s in (("A", a), ("B", b), ("C", c)):
        got = s.restored_chunks
        print(f"{name} restored chunks {got or 'none'} ({len(got)} of {len(X)}, {s.bytes_restored} bytes) "
              f"and computed {len(X) - len(got)}")
