"""The ``telefuser`` runtime: TeleFuser's real LingBot-World-fast loop, with random weights.

`TeleFuserRuntimeFactory` builds one real ``LingBotWorldFastPipeline``
(`cacheseek.integrations.telefuser.tiny`) at any DiT size (tiny by default; LingBot-World's
40 x 40 x 128 with ``+model=lingbot_world_14b``), its DiT built on the runtime's device in
bf16 (0.3-0.7 s for 14 B parameters on an H200, logged with its time), with stand-ins for the VAE
and the text encoder or TeleFuser's own Wan VAE and umT5 encoder (``runtime.vae=wan
runtime.text_encoder=umt5``, the preset's choice), attaches CacheSeek to it (native hooks on a hooked
TeleFuser, installed ones on the 0.1.0.post3 release, the streaming seams on TeleFuser main) and
hands out `TeleFuserSession` objects, which the workloads drive like the synthetic runtime:
``generate(stop_after)``, ``state_snapshot()``, ``latents``, ``frame_hashes``,
``world_kv_cached_latents``. Its ``layout_name`` is the layout adapter the installed TeleFuser
needs (``layout=auto`` follows it).

A session runs chunk by chunk: on the release and the hooked commit with ``create_runtime`` and
``generate_next_chunk``; on TeleFuser main as its service does, with
``_create_initialized_session`` and the pipeline's streaming scheduler, one chunk submitted when
the previous one's frames are out (encode, denoise with the hook, decode, in TeleFuser's actors).
A session is *planned* (the default: its controls are known when it is created, camera poses in
the session config on the release, `plan_controls` on main) or *streamed* (``make(...,
streamed=True)``), as TeleFuser's services run live sessions: the session config holds no poses
and each chunk's control arrives as the chunk starts (the release and hooked:
``generate_next_chunk(runtime, control_override=pipeline.build_control_override(runtime,
chunk))`` with the chunk's latent-frame poses; main: ``submit_chunk(session, i, control)``).

A workload's action per chunk is a small vector (``[a0, a1, a2, ...]`` in [-1, 1]); here it is a
camera move, turned into the inputs a TeleFuser user passes (`camera_path`), which TeleFuser turns
into the control tensors ``[1, 384, 3, h, w]`` float32 that the binding keys on (TeleFuser main
builds one chunk's control from its poses and the pose before it). The moves are rotations, which
reach the DiT unnormalized: TeleFuser normalizes translations by the largest step of the whole
trajectory, which would make the control of an early chunk depend on later actions and defeat
prefix reuse.

Requires the ``telefuser`` extra (``pip install -e '.[telefuser]'``); importing this module does
not import TeleFuser.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from cacheseek import weights
from cacheseek.errors import CacheSeekError, ConfigError
from cacheseek.integrations.telefuser import TeleFuserLayout, attach, plan_controls
from cacheseek.integrations.telefuser.handout import VIDEO_PER_LATENT
from cacheseek.integrations.telefuser.tiny import PARTS, TinyDiTSpec, build_tiny_pipeline, rope_head_dim_problem
from cacheseek.integrations.telefuser.wan_parts import feature_cache_bytes
from cacheseek.registry import RUNTIMES
from cacheseek.runtime import telefuser_sizes
from cacheseek.runtime.geometry import Geometry, check_cpu_memory, check_int, no_cuda_error, validate_window
from cacheseek.runtime.snapshot import ring_snapshot
from cacheseek.runtime.telefuser_logs import route_telefuser_logs
from cacheseek.runtime.telefuser_frames import frame_hash, images_hash, images_tensor, pil_image

__all__ = ["TeleFuserRuntimeFactory", "TeleFuserSession", "camera_path", "frame_hash", "images_hash"]

log = logging.getLogger(__name__)

_DEG = math.pi / 180.0


def camera_path(actions: Sequence[Sequence[float]], *, chunk_size: int, width: int, height: int,
                step_degrees: float = 8.0, translation: bool = False, step: float = 0.1) -> tuple[Any, Any]:
    """Poses ``[N, 4, 4]`` float32 and intrinsics ``[N, 4]`` float32 (``fx, fy, cx, cy``) for
    ``N = 4 * (len(actions) * chunk_size - 1) + 1`` video frames. Latent frame j (video frame 4j,
    where TeleFuser samples the path) turns by ``step_degrees * (a1, a0, a2 / 2)`` (pitch, yaw,
    roll) of its chunk's action; with ``translation`` it also moves ``step * a3`` along its view
    direction (a streamed session's controls normalize translation per chunk; a planned one's
    over the whole trajectory, so planned paths stay rotations). The frames between two samples
    keep the earlier pose, so the control of a chunk depends only on the actions of that chunk and
    the ones before it."""
    import numpy as np
    from scipy.spatial.transform import Rotation

    latent_frames = len(actions) * chunk_size
    n = VIDEO_PER_LATENT * (latent_frames - 1) + 1
    rotation = Rotation.identity()
    position = np.zeros(3, dtype=np.float64)
    per_latent = []
    for j in range(latent_frames):
        if j:
            a = list(actions[j // chunk_size]) + [0.0, 0.0, 0.0, 0.0]
            turn = np.array([a[1], a[0], 0.5 * a[2]], dtype=np.float64) * step_degrees * _DEG
            rotation = rotation * Rotation.from_rotvec(turn)
            if translation:
                position = position + rotation.as_matrix()[:, 2] * step * a[3]
        per_latent.append((rotation.as_matrix(), position.copy()))
    poses = np.tile(np.eye(4, dtype=np.float32), (n, 1, 1))
    for f in range(n):
        poses[f, :3, :3], poses[f, :3, 3] = per_latent[f // VIDEO_PER_LATENT]
    focal = float(max(width, height))
    intrinsics = np.tile(np.array([[focal, focal, width / 2.0, height / 2.0]], dtype=np.float32), (n, 1))
    return poses, intrinsics


@RUNTIMES.register("telefuser")
class TeleFuserRuntimeFactory:
    """One real pipeline with random weights; `make()` opens one session on it. Its settings
    (``runtime: telefuser``): sizes of the DiT and the video (``ffn_dim`` None = 2 x dim);
    ``vae`` (``stand_in`` or ``wan``) and ``text_encoder`` (``stand_in`` or ``umt5``, of
    ``text_layers`` blocks) choose TeleFuser's real part with random weights or the stand-in."""

    ACTIVATION_HEADROOM = 2 << 30  # beyond the ring and the FFN's activations: allocator slack, the VAE

    def __init__(self, *, local_attn_size: int = -1, sink_size: int = 0, device: str = "cpu",
                 seed: int = 42, prompt: str = "a red car driving along a coast road", height: int = 64,
                 width: int = 64, n_layers: int = 2, n_heads: int = 2, head_dim: int = 12,
                 ffn_dim: Optional[int] = None, text_dim: int = 32, weight_seed: int = 0, vae: str = "stand_in",
                 text_encoder: str = "stand_in", text_layers: int = 24) -> None:
        for name, value, low in (("height", height, 16), ("width", width, 16), ("n_layers", n_layers, 1),
                                 ("n_heads", n_heads, 1), ("head_dim", head_dim, 2), ("seed", seed, 0),
                                 ("ffn_dim", 1 if ffn_dim is None else ffn_dim, 1), ("text_dim", text_dim, 1),
                                 ("text_layers", text_layers, 1)):
            check_int(f"runtime.{name}", value, low)
        for name, value in (("height", height), ("width", width)):
            if value % 16:
                raise ConfigError(f"runtime.{name}", f"{value} is not a multiple of 16",
                                  "TeleFuser's VAE and patching need multiples of 16")
        for name, value in (("vae", vae), ("text_encoder", text_encoder)):
            if value not in PARTS[name]:
                raise ConfigError(f"runtime.{name}", f"unknown part {value!r}", f"use one of: {', '.join(PARTS[name])}")
        self._parts = {"vae": vae, "text_encoder": text_encoder, "text_layers": text_layers}
        problem = rope_head_dim_problem(head_dim)
        if problem:
            raise ConfigError("runtime.head_dim", f"TeleFuser's DiT cannot run it: {problem}",
                              "use a head_dim with head_dim % 6 in (0, 2): 12, 14, 126, 128 (LingBot-World)")
        self._geometry = Geometry(name="telefuser", n_layers=n_layers, n_heads=n_heads, head_dim=head_dim,
                                  latent_channels=16, latent_h=height // 8, latent_w=width // 8, chunk_size=3)
        validate_window(self._geometry, local_attn_size, sink_size)
        self._local_attn_size, self._sink_size = local_attn_size, sink_size
        self.seed, self.prompt, self.height, self.width = seed, prompt, height, width
        self._device = _check_device(device, self._geometry)
        self._weight_seed = weight_seed
        self._ffn_dim, self._text_dim = ffn_dim, text_dim
        self._pipeline: Any = None
        self.layout: Any = None
        self._adapter: Any = None
        self._weights: Optional[bytes] = None
        self._vae_cache: Optional[int] = None
        self.build_timings: dict[str, float] = {}  # the DiT's build and its fingerprint, once built

    # the settings the orchestrator and workloads read
    geometry = property(lambda self: self._geometry)
    local_attn_size = property(lambda self: self._local_attn_size)
    sink_size = property(lambda self: self._sink_size)
    device = property(lambda self: self._device)
    dtype = property(lambda self: "bfloat16")
    parts = property(lambda self: dict(self._parts))  # vae, text_encoder, text_layers

    @property
    def built(self) -> bool:
        """Whether `pipeline` was built yet (on its first use: geometry checks build nothing)."""
        return self._pipeline is not None

    @property
    def pipeline(self) -> Any:
        """The attached pipeline, built on first use."""
        if self._pipeline is None:
            _require_telefuser()
            import torch

            spec = self._spec()
            log.info("building TeleFuser's pipeline %s on %s (DiT in bf16)", self.describe_model(), self._device)
            start = time.perf_counter()
            pipeline = build_tiny_pipeline(device=self._device, local_attn_size=self._local_attn_size,
                                           sink_size=self._sink_size, height=self.height,
                                           width=self.width, spec=spec, **self._parts)
            if self._device.startswith("cuda"):
                torch.cuda.synchronize(self._device)
            built = time.perf_counter()
            n = sum(p.numel() for p in pipeline.dit.parameters())
            parts = {name: sum(p.numel() for p in getattr(pipeline, name).parameters())
                     for name in ("vae", "text_encoder") if self._parts[name] != "stand_in"}
            log.info("TeleFuser's pipeline %s: DiT %.2f B random bf16 weights%s, built on %s in %.2f s",
                     self.describe_model(), n / 1e9,
                     "".join(f", {k} {v / 1e9:.2f} B" for k, v in parts.items()), self._device, built - start)
            self._weights = weights.module_fingerprint(pipeline.dit)  # the module itself, before attach wraps it
            self.build_timings = {"parameters": n, "parts_parameters": parts, "pipeline_s": built - start,
                                  "fingerprint_s": time.perf_counter() - built}
            self.layout = attach(pipeline)
            self._pipeline = pipeline
        return self._pipeline

    def _spec(self) -> TinyDiTSpec:
        g = self._geometry
        return TinyDiTSpec(n_layers=g.n_layers, n_heads=g.n_heads, head_dim=g.head_dim, text_dim=self._text_dim,
                           ffn_dim=self._ffn_dim, weight_seed=self._weight_seed)

    def describe_model(self) -> str:
        g, spec = self._geometry, self._spec()
        parts = {"wan": ", Wan VAE", "umt5": f", umT5 x{self._parts['text_layers']}", "stand_in": ""}
        return (f"{g.n_layers}x{g.n_heads}x{g.head_dim} ffn {spec.ffn_dim} text {spec.text_dim} {self.height}x{self.width}"
                f"{parts[self._parts['vae']]}{parts[self._parts['text_encoder']]}")

    def start_notes(self) -> list[str]:
        """What a user should know before the run, one line each."""
        if self._parts["vae"] != "wan" or not self._device.startswith("cpu"):
            return []
        return ["note: runtime.vae=wan on the CPU: the Wan VAE decodes every frame, restored or computed, and takes "
                "most of a chunk's time here; a hit skips only the DiT, so B's wall time stays close to A's (cold). "
                "The cache's saving shows with runtime.vae=stand_in on a CPU, or on a GPU at the real size"]

    def device_reserve(self, chunks: int) -> list[tuple[str, int]]:
        """What a session still allocates on the runtime's device (`sizing.runtime_device_room`),
        the weights built first: its ring of ``chunks`` chunks (or the attention window), the
        activations of one chunk (a few FFN-wide buffers in float32) plus `ACTIVATION_HEADROOM`,
        and with the Wan VAE three times its decoder's feature cache (`wan_parts`)."""
        self.pipeline
        g, spec = self._geometry, self._spec()
        frames = self._local_attn_size if self._local_attn_size > 0 else chunks * g.chunk_size
        ring = 2 * g.n_layers * frames * g.frame_tokens * g.hidden * 2
        activations = 8 * g.chunk_tokens * max(spec.ffn_dim, g.hidden) * 4 + self.ACTIVATION_HEADROOM
        reserve = [("ring", ring), ("activations", activations)]
        if self._parts["vae"] == "wan":  # its causal cache between chunks, and twice that for a decode's activations
            reserve.append(("Wan VAE decode", 3 * self._vae_cache_bytes()))
        return reserve

    def beside_chunk_bytes(self, decoder_state_every: int) -> dict[str, int]:
        """`telefuser_sizes.beside_chunk_bytes`; the decoder's state counts with the Wan VAE and
        ``decoder_state_every > 0`` (its feature cache measured on the pipeline, built first)."""
        cache = self._vae_cache_bytes() if decoder_state_every > 0 and self._parts["vae"] == "wan" else None
        return telefuser_sizes.beside_chunk_bytes(self._geometry, height=self.height, width=self.width,
                                                  decoder_cache_bytes=cache)

    def session_encode_bytes(self, session_chunks: int) -> int:
        return telefuser_sizes.session_encode_bytes(self._geometry, text_dim=self._text_dim,
                                                    session_chunks=session_chunks)

    def _vae_cache_bytes(self) -> int:
        """The Wan decoder's feature cache (`wan_parts`), estimated once on the built pipeline."""
        if self._vae_cache is None:
            self._vae_cache = feature_cache_bytes(self.pipeline.vae.vae, height=self.height, width=self.width)
        return self._vae_cache

    @property
    def layout_name(self) -> str:
        """The layout adapter for the installed TeleFuser's sessions (``bshd`` or ``telefuser_main``)."""
        self.pipeline
        return self.layout.layout_name

    @property
    def layout_adapter(self) -> Any:
        """The adapter through which sessions read their ring (the ring check's snapshots)."""
        if self._adapter is None:
            self.pipeline
            self._adapter = self.layout.adapter()
        return self._adapter

    @property
    def weights_fingerprint(self) -> bytes:
        """The DiT's weights fingerprint (`cacheseek.weights`): two checkpoints never share a namespace."""
        self.pipeline
        return self._weights

    def describe(self) -> dict[str, Any]:
        """What a report names: TeleFuser's version and layout, the model size, the device."""
        import importlib.metadata

        import telefuser

        self.pipeline  # the layout is known once the pipeline is attached
        here = Path(telefuser.__path__[0]).resolve()
        try:
            dist = importlib.metadata.distribution("telefuser")
            installed = Path(dist.locate_file("telefuser")).resolve() == here
            version = dist.version if installed else "a source checkout"
        except importlib.metadata.PackageNotFoundError:
            version = "a source checkout"
        return {"runtime": "telefuser", "layout": self.layout.value, "telefuser": version,
                "telefuser_path": str(here), "model": self.describe_model(), "device": self._device}

    def make(self, actions: Sequence[Sequence[float]], hooks: Any = None, total_chunks: Optional[int] = None,
             *, image: Any = None, streamed: bool = False) -> "TeleFuserSession":
        """A session of ``actions``; ``streamed``: its controls arrive chunk by chunk (see above)."""
        actions = list(actions)[: total_chunks or len(actions)]
        if not actions:
            raise ConfigError("runtime.actions", "a session needs at least one chunk's action")
        return TeleFuserSession(self, actions, hooks, image, streamed=streamed)

    def session_config(self, actions: Sequence[Sequence[float]], image: Any = None, *,
                       streamed: bool = False) -> Any:
        from telefuser.pipelines.lingbot_world_fast.session import LingBotWorldFastSessionConfig

        c = self._geometry.chunk_size
        poses, intrinsics = camera_path(actions, chunk_size=c, width=self.width, height=self.height)
        camera = {} if self.streaming or streamed else {"poses": poses, "intrinsics": intrinsics}
        return LingBotWorldFastSessionConfig(
            prompt=self.prompt, image=pil_image(image, self.width, self.height), control_mode="cam",
            chunk_size=c, frame_num=len(poses), seed=self.seed, **camera)

    @property
    def streaming(self) -> bool:
        """TeleFuser main's layout: sessions streamed through the pipeline's scheduler."""
        self.pipeline
        return self.layout is TeleFuserLayout.MAIN

    def chunk_override(self, runtime: Any, actions: Sequence[Sequence[float]], k: int) -> Any:
        """The release's (and the hooked commit's) control override of chunk ``k``, built by
        TeleFuser's ``build_control_override`` from the chunk's latent-frame poses, as its
        service builds one per streamed chunk."""
        c = self._geometry.chunk_size
        latent_poses, intrinsics = self._latent_poses(actions, translation=True)
        chunk = {"poses": latent_poses[k * c:(k + 1) * c], "intrinsics": intrinsics}
        return self.pipeline.build_control_override(runtime, chunk)

    def chunk_controls(self, session_config: Any, actions: Sequence[Sequence[float]], *,
                       translation: bool = False) -> list[Any]:
        """TeleFuser main's control tensor of each chunk, built by TeleFuser from the chunk's
        latent-frame poses and the pose before them (as its realtime service builds them)."""
        from telefuser.pipelines.lingbot_world_fast.control import LingBotWorldFastControlBuilder

        c = self._geometry.chunk_size
        latent_poses, intrinsics = self._latent_poses(actions, translation=translation)
        builder = LingBotWorldFastControlBuilder(self.pipeline.control_context(session_config))
        controls = []
        for k in range(len(actions)):
            action = {"poses": latent_poses[k * c:(k + 1) * c], "intrinsics": intrinsics}
            if k:
                action["previous_pose"] = latent_poses[k * c - 1]
            controls.append(builder.build(action))
        return controls

    def _latent_poses(self, actions: Sequence[Sequence[float]], *, translation: bool) -> tuple[Any, Any]:
        """`camera_path`'s poses at the latent frames (where TeleFuser samples it), and the intrinsics."""
        poses, intrinsics = camera_path(actions, chunk_size=self._geometry.chunk_size, width=self.width,
                                        height=self.height, translation=translation)
        return poses[::VIDEO_PER_LATENT], intrinsics[0]


class TeleFuserSession:
    """One session on the real pipeline. ``hooks`` (a binding or None) is set as
    ``session_config.world_kv_binding``; TeleFuser (or the installed hooks) calls it."""

    def __init__(self, factory: TeleFuserRuntimeFactory, actions: list, hooks: Any, image: Any, *,
                 streamed: bool = False) -> None:
        self.factory = factory
        self.pipeline = factory.pipeline
        self.actions = actions
        self.streamed = streamed
        self.session_config = factory.session_config(actions, image, streamed=streamed)
        self.session_config.world_kv_binding = hooks
        self.total_chunks = len(actions)
        self.runtime: Any = None
        self.frame_hashes: list[bytes] = []
        self.keep_frames = False  # True: ``frames`` keeps each chunk's frames (a lossy codec's quality verdict)
        self.frames: list[Any] = []
        self.latents: list[Any] = []
        self.next_chunk = 0
        self._stream: Optional[_StreamedChunks] = None
        self._controls: Optional[list] = None
        if factory.streaming:
            self._controls = factory.chunk_controls(self.session_config, actions, translation=streamed)
            if not streamed:
                plan_controls(self.session_config, self._controls)

    def generate(self, stop_after: Optional[int] = None) -> list[bytes]:
        """Create the runtime (the binding restores here) and run chunks until ``stop_after`` are
        done (default all). On the release and the hooked commit a frame hash is the sha256 of
        the uint8 frames ``generate_next_chunk`` hands out (what the user gets: a chunk served
        from stored frames is never decoded); on TeleFuser main, whose actors hand frames to its
        service, of the decoded frames before TeleFuser's uint8 conversion. A served chunk has no
        latent here (None in ``latents``)."""
        stop = self.total_chunks if stop_after is None else stop_after
        if not 0 <= stop <= self.total_chunks:
            raise ConfigError("stop_after", f"{stop} is outside 0..{self.total_chunks}")
        self.start()
        vae = self.pipeline.vae
        hooks = self.session_config.world_kv_binding
        while self.next_chunk < stop:
            served = hooks.frames_served if hooks is not None else 0
            if self._stream is None and self.streamed:
                override = self.factory.chunk_override(self.runtime, self.actions, self.next_chunk)
                images = self.pipeline.generate_next_chunk(self.runtime, control_override=override)
            elif self._stream is None:
                images = self.pipeline.generate_next_chunk(self.runtime)
            else:
                self._stream.run(self.next_chunk, self._controls[self.next_chunk])
                images = None
            handed_out = hooks is not None and hooks.frames_served > served
            self.frame_hashes.append(frame_hash(vae.last_frames) if images is None else images_hash(images))
            if self.keep_frames:  # what the user gets: a served chunk is never decoded
                self.frames.append(vae.last_frames.detach().float().cpu() if images is None else images_tensor(images))
            self.latents.append(None if handed_out else vae.last_latent)
            self.next_chunk += 1
        if self._stream is not None and self.next_chunk == self.total_chunks:
            self._stream.close()  # releases the session's caches, as generate_video does
        return list(self.frame_hashes)

    @property
    def controls(self) -> Optional[list]:
        """On TeleFuser main, the control each chunk is submitted with (built from ``actions`` as
        its service builds them); None on the release and the hooked commit, whose pipeline
        builds each chunk's control itself."""
        return self._controls

    def start(self) -> None:
        """Create the session's runtime (the binding restores here) without running a chunk;
        `generate` starts it itself. Idempotent."""
        if self.runtime is not None:
            return
        if not self.factory.streaming:
            self.runtime = self.pipeline.create_runtime(self.session_config)
            return
        self.runtime = self.pipeline._create_initialized_session(self.session_config)
        self._stream = _StreamedChunks(self.pipeline, self.runtime)

    def materialize_restored(self) -> int:
        """Restore what the session served from frames into its runtime now, as its divergence
        would (the ring check compares that state with a cold run's); chunks restored."""
        self.start()
        hooks = self.session_config.world_kv_binding
        if hooks is None or self._stream is not None:
            return 0
        return hooks.materialize(self.runtime)

    def state_snapshot(self) -> dict:
        """The state the next chunk computes on: what the session served from frames is
        restored into the runtime first (`materialize_restored`), as its next computed chunk would."""
        self.materialize_restored()
        return ring_snapshot(self.runtime, self.factory.layout_adapter, next_chunk=self.next_chunk)

    @property
    def world_kv_cached_latents(self) -> dict:
        return {} if self.runtime is None else self.runtime.world_kv_cached_latents

    @property
    def self_kv_cache(self) -> Any:
        return self.factory.layout_adapter.ring_layers(self.runtime)


class _StreamedChunks:
    """One session on TeleFuser main's streaming scheduler, one chunk at a time."""

    TIMEOUT_S = 300.0

    def __init__(self, pipeline: Any, runtime: Any) -> None:
        self.runtime = runtime
        self.streaming = pipeline._get_streaming_runtime()
        self.session = self.streaming.create_session(runtime)
        self.closed = False

    def run(self, index: int, control: Any) -> None:
        """Submit chunk ``index`` and wait until its frames are decoded."""
        s, session = self.streaming, self.session
        s.submit_chunk(session, index, control)
        deadline = time.monotonic() + self.TIMEOUT_S
        while True:
            error = s.error(session)
            if error is not None:
                raise CacheSeekError(f"TeleFuser's streaming scheduler failed at chunk {index}: {error}") from error
            out = s.poll_frames(session)
            if out:
                if [i for i, _ in out] != [index]:
                    raise CacheSeekError(f"expected the frames of chunk {index}, got chunks {[i for i, _ in out]}")
                break
            if time.monotonic() > deadline:
                raise CacheSeekError(f"chunk {index} not decoded within {self.TIMEOUT_S} s")
            s.wait_until_idle(session, timeout=0.05)
        self.runtime.current_chunk_index = index + 1

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.streaming.close_session(self.session)


def _check_device(device: Any, geometry: Geometry) -> str:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError("runtime.device", f"unknown device {device!r}", "use cpu or cuda[:N]") from None
    cpu_run = "runtime=telefuser runtime.device=cpu (TeleFuser's real pipeline at its default 2 layers, 64x64)"
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise no_cuda_error(geometry, cpu_run)
    if dev.type == "cpu":
        check_cpu_memory(geometry, cpu_run)
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError("runtime.device", f"unsupported device {device!r}", "use cpu or cuda[:N]")
    return str(dev)


def _require_telefuser() -> None:
    """Import TeleFuser's pipeline, its log lines routed to the run's log first (`telefuser_logs`)."""
    try:
        route_telefuser_logs()
        import telefuser.pipelines.lingbot_world_fast  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "runtime", f"runtime=telefuser needs TeleFuser's LingBot-World-fast pipeline ({exc})",
            "pip install -e '.[telefuser]' (then pip install --no-deps telefuser==0.1.0.post3, see README)") from None
