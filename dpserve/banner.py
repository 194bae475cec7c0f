"""What ``dpserve serve`` prints once it serves: where, and calls to try that fit the
model it serves (an image model's generation, a video model's job), each one a
command that works as printed."""

from __future__ import annotations

from dataclasses import dataclass

from dpserve.contract.model_info import ModelInfo

_CT = "-H 'Content-Type: application/json'"


@dataclass(frozen=True)
class ModelFacts:
    """A replica's model_info, as much as the banner needs; known=False: none came."""

    known: bool = False
    video: bool = False
    text_to_video: bool = True  # False: an image-to-video model needs an input image
    realtime: bool = False
    size_factor: int = 16

    @classmethod
    def of(cls, info: ModelInfo) -> ModelFacts:
        video = info.features.video
        return cls(
            known=True,
            video=video is not None,
            text_to_video=video.text_to_video if video is not None else True,
            realtime=info.realtime == "supported",
            size_factor=info.size_factor,
        )


@dataclass(frozen=True)
class Ready:
    url: str
    replicas: int
    model: str
    endpoints: list[str]
    keyed: bool  # with keys, the commands say which key goes where, never the key itself
    took_s: float


def banner(ready: Ready, model: ModelFacts) -> str:
    url = ready.url
    api = " -H 'Authorization: Bearer <your --api-key>'" if ready.keyed else ""
    admin = " -H 'Authorization: Bearer <your --admin-key>'" if ready.keyed else ""
    lines = [
        "",
        f"dpserve ready in {ready.took_s:.1f}s: {ready.replicas} replica(s) of {ready.model}"
        f" behind {url}",
        f"  drivers on {', '.join(ready.endpoints)}",
    ]
    if not model.known:
        lines.append(f"  what it serves: curl -s {url}/v1/models{api}")
    elif model.video:
        lines += ["  try (a video job, then its status, then its mp4):", *_video(url, api, model)]
    else:
        lines += ["  try:", *_image(url, api)]
    lines.append(f"    curl -s {url}/health/replicas{admin}")
    if model.realtime:
        ws = url.replace("http", "ws", 1)
        lines.append(f"  realtime sessions: {ws}/v1/realtime_video/generate (docs/realtime.md)")
    lines += [f"  every route: {url}/docs", "  Ctrl-C stops everything.", ""]
    return "\n".join(lines)


def _image(url: str, api: str) -> list[str]:
    body = '{"prompt": "a lighthouse at dusk", "size": "256x256", "num_inference_steps": 8, '
    body += '"seed": 1}'
    return [
        f"    curl -s {url}/v1/images/generations {_CT}{api} \\",
        f"      -d '{body}' | head -c 300; echo",
    ]


def _video(url: str, api: str, model: ModelFacts) -> list[str]:
    # Small and short: a first job that any Wan-family model makes quickly.
    size = f"{4 * model.size_factor}x{3 * model.size_factor}"
    if model.text_to_video:
        body = f'{{"prompt": "a paper boat on a pond", "size": "{size}", "seconds": "1", '
        body += '"num_inference_steps": 8, "seed": 7}'
        submit = [f"    curl -s {url}/v1/videos {_CT}{api} \\", f"      -d '{body}'"]
    else:  # image-to-video: the job animates an image of the caller's
        form = f"-F prompt='a paper boat on a pond' -F size={size} -F seconds=1"
        form += " -F num_inference_steps=8 -F seed=7"
        submit = [
            f"    curl -s {url}/v1/videos{api} {form} \\",
            "      -F input_reference=@YOUR_IMAGE.png",
        ]
    return [
        *submit,
        f"    curl -s {url}/v1/videos/VIDEO_ID{api}    # the id it answered: status, progress",
        f"    curl -s {url}/v1/videos/VIDEO_ID/content{api} -o video.mp4",
    ]
