"""Two defects of TeleFuser main's LingBot-World-fast that CacheSeek's harness and seams work
around, shown on TeleFuser's own code (run against a TeleFuser main checkout):

1. one device: TeleFuser's ``init()`` uses a plain denoise stage when ``dit_config`` has one device;
   ``_create_initialized_session`` allocates its ring under ``torch.inference_mode`` and the
   denoise actor thread (not in inference mode) writes it, so the first chunk fails. The tiny
   harness runs the stage through `InProcessWorker` (outside inference mode, as a worker process).
2. decode-only hits: TeleFuser casts a cached latent to the pipeline's dtype (bf16) before the
   decoder, while computed chunks decode x0 as the DiT returns it (float32). A float32 Wan VAE
   (TeleFuser's default VAE configs and its LingBot example) refuses the bf16 latent; shown here
   on TeleFuser's real ``WanVideoVAE`` with random weights. CacheSeek's decode seam
   (`cacheseek.integrations.telefuser.streaming`) hands the decoder the restored latent as stored;
   without it the hit session fails.

    python experiments/telefuser_real/main_findings.py --telefuser-src /tmp/tf_main --telefuser-commit 5a12f03

Writes results_main_findings.md here (or in --out).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ACTIONS = [[0.1, 0.2, 0.0, 0.0], [0.3, -0.4, 0.1, 0.0], [0.5, 0.1, 0.0, 0.2]]


def one_device_stage() -> str:
    """Generate one session with the denoise stage as init() leaves it on one device."""
    from cacheseek.runtime.telefuser import TeleFuserRuntimeFactory

    factory = TeleFuserRuntimeFactory()
    pipeline = factory.pipeline
    pipeline.denoise_stage = pipeline.denoise_stage.stage  # the plain stage, no worker
    try:
        factory.make(ACTIONS).generate()
    except Exception as exc:
        cause = exc.__cause__ or exc
        return f"fails at the first chunk: {type(cause).__name__}: {str(cause).splitlines()[0]}"
    return "ran (the defect is fixed in this checkout)"


def wan_vae_on_a_bf16_latent() -> str:
    import torch
    from telefuser.models.wan_video_vae import WanVideoVAE, WanVideoVAEStreamingDecodeState

    torch.manual_seed(0)
    vae = WanVideoVAE().eval()
    latent = torch.randn(1, 16, 3, 4, 4)
    out = []
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            try:
                frames = vae.cached_decode_withflag(latent.to(dtype), device=torch.device("cpu"), is_first_clip=True,
                                                    is_last_clip=False, decode_state=WanVideoVAEStreamingDecodeState())
                out.append(f"{dtype} latent -> frames {tuple(frames.shape)} {frames.dtype}")
            except Exception as exc:
                out.append(f"{dtype} latent -> {type(exc).__name__}: {exc}")
    return f"WanVideoVAE (weights {next(vae.parameters()).dtype}): " + "; ".join(out)


def hit_without_the_decode_seam() -> str:
    """A restored session on the tiny pipeline, once with CacheSeek's decode seam, once without."""
    from cacheseek.reuse.exact_prefix import InMemoryTierStore, NamespaceForest, WorldKVManager
    from cacheseek.reuse.exact_prefix.telefuser_lingbot import LingBotWorldKVBinding, make_full_kv_config
    from cacheseek.runtime.telefuser import TeleFuserRuntimeFactory

    lines = []
    for seam in (True, False):
        factory = TeleFuserRuntimeFactory()
        pipeline = factory.pipeline
        if not seam:  # before the first generation: the streaming runtime takes the worker then
            pipeline.vae_decode_worker = pipeline._cacheseek_hooks._decode_worker
        manager = WorldKVManager(NamespaceForest(), InMemoryTierStore(), make_full_kv_config())

        def binding():
            return LingBotWorldKVBinding(manager, manager.forest, layout=factory.layout_adapter,
                                         model_fingerprint=factory.weights_fingerprint)

        cold = factory.make(ACTIONS, hooks=binding())
        cold_hashes = cold.generate()
        warm_binding = binding()
        warm = factory.make(ACTIONS, hooks=warm_binding)
        try:
            hashes = warm.generate()
            lines.append(f"decode seam {'on' if seam else 'off'}: restored K={warm_binding.last_fast_forward}, "
                         f"frames == cold: {hashes == cold_hashes}")
        except Exception as exc:
            cause = exc.__cause__ or exc
            lines.append(f"decode seam {'on' if seam else 'off'}: restored K={warm_binding.last_fast_forward}, "
                         f"the session fails: {type(cause).__name__}: {cause}")
    return "; ".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--telefuser-src", required=True)
    ap.add_argument("--telefuser-commit", default="")
    ap.add_argument("--out", default=str(HERE))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(args.telefuser_src).resolve()))
    sys.path.insert(0, str(HERE.parent))
    import torch

    from benchlib import env_info

    torch.set_num_threads(1)
    rows = [("one-device denoise stage, as init() sets it", one_device_stage()),
            ("TeleFuser's Wan VAE on a float32 and a bf16 latent", wan_vae_on_a_bf16_latent()),
            ("a restored session on the tiny pipeline", hit_without_the_decode_seam())]
    env = env_info()
    text = "\n".join([
        "# TeleFuser main: what the harness and CacheSeek's seams work around", "",
        f"- TeleFuser: `{args.telefuser_src}`, commit {args.telefuser_commit}",
        f"- python {env.get('python')}, torch {env.get('torch')}; {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"- command: `python experiments/telefuser_real/main_findings.py {' '.join(argv or sys.argv[1:])}`", "",
        *[f"- **{what}**: {result}" for what, result in rows], ""])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results_main_findings.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
