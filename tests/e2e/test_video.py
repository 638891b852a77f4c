"""Video parts through the gateway, with the official openai client and real SGLang workers.

Ports the portable checks of SGLang's test/srt/test_vision_openai_server_common.py (VideoOpenAITestMixin:
test_video_chat_completion, and test_video_images_chat_completion's frames sent as images), with a video made from
a bundled picture instead of a downloaded one and the answer-content checks made structural: the bundled model is
random, so the gateway's answer is compared with plain SGLang's instead.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import ImageLimits, VideoSettings
from gateway.videos import sampled_frames
from store import StoreConfig
from tests.conftest import gateway_config, remove_store_memory, run_gateway
from tests.http_server import serve
from tests.images_lib import data_url, encode
from tests.openai_schema import assert_valid
from tests.videos_lib import decoded_frames, encode_video, pan, walker

pytestmark = pytest.mark.sglang

QUESTION = "Please describe the video in detail."
VIDEO = encode_video(pan("astronaut.png", frames=12), fps=4)  # 3 s; the model samples 6 frames
OTHER = encode_video(pan("coffee.png", frames=12, step=5), fps=4)


def video_part(data: bytes, mime: str = "video/mp4") -> dict:
    return {"type": "video_url", "video_url": {"url": data_url(data, mime)}}


def messages(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


def ask(client, gateway, video: bytes | str, **kwargs):
    """One video (bytes, sent inline, or a URL) and the question, answered greedily."""
    part = video_part(video) if isinstance(video, bytes) else {"type": "video_url", "video_url": {"url": video}}
    return client.chat.completions.with_raw_response.create(
        model=gateway.config.model, messages=messages(part), temperature=0, max_tokens=6, **kwargs)


def frames_counted(gateway) -> dict[str, float]:
    text = httpx.get(gateway.url + "/metrics", timeout=30).text
    return {s.labels["seen"]: s.value for f in text_string_to_metric_families(text) if f.name == "revisit_video_frames"
            for s in f.samples if s.name.endswith("_total")}


def seen(raw) -> tuple[int, int, int]:
    """(sampled, seen as image, seen in video) from the x-revisit-video-frames header of a one-video request."""
    sampled, as_image, in_video = raw.headers["x-revisit-video-frames"].split(";")
    return int(sampled), int(as_image.split("=")[1]), int(in_video.split("=")[1])


def test_video_chat_completion_answers_as_plain_sglang(client, gateway, workers):
    raw = ask(client, gateway, OTHER)
    assert_valid(raw.http_response.json(), "CreateChatCompletionResponse")
    completion = raw.parse()
    assert completion.object == "chat.completion" and completion.choices[0].finish_reason in ("length", "stop")
    assert isinstance(completion.choices[0].message.content, str)
    direct = httpx.post(workers[0].url + "/v1/chat/completions", timeout=300, json={
        "model": gateway.config.model, "messages": messages(video_part(OTHER)), "temperature": 0,
        "max_tokens": 6}).json()
    assert completion.choices[0].message.content == direct["choices"][0]["message"]["content"]
    assert completion.usage.prompt_tokens == direct["usage"]["prompt_tokens"] > 6 * 4  # the frames' tokens


def test_a_repeated_video_is_counted_and_kept_to_its_worker(client, gateway):
    before = frames_counted(gateway)
    first = ask(client, gateway, VIDEO)
    sampled, _, in_video = seen(first)
    assert sampled == len(sampled_frames(12, 4.0, VideoSettings())) == 6 and in_video == 0
    assert first.headers["x-revisit-video-patches"] == "3;exact=0"  # patches not matched as near-duplicates here
    again = ask(client, gateway, VIDEO)
    assert seen(again) == (6, 0, 6)
    assert again.headers["x-revisit-video-patches"] == "3;exact=3"
    answer, repeat = first.parse(), again.parse()
    assert repeat.choices[0].message.content == answer.choices[0].message.content
    # Kept to the worker that served it: its prefix cache holds the whole prompt but the last token.
    assert repeat.usage.prompt_tokens_details.cached_tokens >= repeat.usage.prompt_tokens - 8
    after = frames_counted(gateway)
    assert after.get("video", 0) - before.get("video", 0) >= 6 and after.get("new", 0) - before.get("new", 0) >= 6


def kinds(reuse_header: str) -> set[str]:
    """The plan kinds of x-revisit-reuse (without ;prefix_cached and the like)."""
    return {part.split(";")[0] for part in reuse_header.split(",")}


def test_frames_sent_as_images_before_are_recognised_in_the_video(client, gateway):
    video = encode_video(pan("rocket.jpg", frames=12, step=7), fps=4)
    frames = decoded_frames(video)
    sampled = [frames[i] for i in sampled_frames(len(frames), 4.0, VideoSettings())]
    as_images = [{"type": "image_url", "image_url": {"url": data_url(encode(frame))}} for frame in sampled]
    for _ in range(10):  # until they are exact hits: stored (the workers write entries in the background)
        raw = client.chat.completions.with_raw_response.create(
            model=gateway.config.model, messages=messages(*as_images), temperature=0, max_tokens=2)
        if kinds(raw.headers["x-revisit-reuse"]) == {"exact_same_prefix"}:
            break
    assert kinds(raw.headers["x-revisit-reuse"]) == {"exact_same_prefix"}
    assert seen(ask(client, gateway, video)) == (6, 6, 0)


def test_another_tenant_sees_nothing_of_a_video(gateway):
    video = encode_video(pan("chelsea.png", frames=8, step=4), fps=4)
    answers = []
    for api_key in ("sk-video-a", "sk-video-b"):
        with openai.OpenAI(base_url=gateway.url + "/v1", api_key=api_key, max_retries=0, timeout=300) as tenant:
            raw = ask(tenant, gateway, video)
        assert seen(raw)[1:] == (0, 0)
        answers.append(raw.parse())
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    # Nor its KV: the second tenant's prefill found none of the first's video in the worker's prefix cache.
    assert answers[1].usage.prompt_tokens_details.cached_tokens < 16


def test_streamed_video_answer_equals_the_whole_one(client, gateway):
    whole = ask(client, gateway, OTHER).parse().choices[0].message.content
    stream = client.chat.completions.create(model=gateway.config.model, messages=messages(video_part(OTHER)),
                                            temperature=0, max_tokens=6, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == whole


def test_a_video_beside_images_in_one_request(client, gateway):
    picture = data_url(encode(decoded_frames(OTHER)[0]))
    raw = client.chat.completions.with_raw_response.create(
        model=gateway.config.model, temperature=0, max_tokens=2,
        messages=messages({"type": "image_url", "image_url": {"url": picture}}, video_part(VIDEO)))
    assert raw.http_response.status_code == 200 and raw.headers["x-revisit-reuse"]
    assert seen(raw)[0] == 6


def test_webm_and_avi(client, gateway):
    for codec, fmt, mime in (("libvpx-vp9", "webm", "video/webm"), ("mpeg4", "avi", "video/x-msvideo")):
        data = encode_video(pan("astronaut.png", frames=8, step=9), fps=4, codec=codec, fmt=fmt)
        raw = client.chat.completions.with_raw_response.create(
            model=gateway.config.model, messages=messages(video_part(data, mime)), temperature=0, max_tokens=2)
        assert raw.http_response.status_code == 200 and seen(raw)[0] == 4


def test_bad_videos_are_refused_and_the_gateway_stays_healthy(client, gateway):
    for bad, status in ((VIDEO[: len(VIDEO) // 3], 422), (b"not a video", 422), (encode_video(pan(frames=1)), 422)):
        with pytest.raises(openai.APIStatusError) as info:
            ask(client, gateway, bad)
        assert info.value.status_code == status, info.value.response.text
        assert "messages[0].content[0].video_url" in info.value.message
    for part, field in (({"type": "video_url", "video_url": {"url": data_url(VIDEO, "video/mp4"), "fps": 1}},
                         "video_url.fps"),
                        ({"type": "video_url", "video_url": "data:video/mp4;base64,AAAA"}, "video_url")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=gateway.config.model, messages=messages(part), max_tokens=1)
        assert info.value.body["param"] == f"messages[0].content[0].{field}"
    with pytest.raises(openai.BadRequestError, match="only allowed in user messages"):
        client.chat.completions.create(model=gateway.config.model, max_tokens=1, messages=[
            {"role": "user", "content": QUESTION}, {"role": "assistant", "content": [video_part(VIDEO)]}])
    assert ask(client, gateway, OTHER).http_response.status_code == 200


def test_limits_and_remote_videos(workers, model_path):
    """A gateway with tight video limits, allowed to fetch from loopback as an operator would for an internal
    media store."""
    server = run_gateway(gateway_config(model_path, [w.url for w in workers],
                                        images=ImageLimits(allow_private_urls=True),
                                        videos=VideoSettings(max_seconds=2.5, max_bytes=len(VIDEO) + 10,
                                                             max_per_request=1)))
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0, timeout=300) as client:
            short = encode_video(pan(frames=8), fps=4)  # 2 s
            with serve({"/clip.mp4": (200, {"Content-Type": "video/mp4"}, short),
                        "/long.mp4": (200, {"Content-Type": "video/mp4"}, VIDEO)}) as host:
                fetched = ask(client, server, host + "/clip.mp4")
                assert fetched.http_response.status_code == 200 and seen(fetched)[0] == 4
                inline = ask(client, server, short)
                assert seen(inline) == (4, 0, 4)  # the same video: keyed by its bytes, however it came
                assert inline.parse().choices[0].message.content == fetched.parse().choices[0].message.content
                for url, code in ((host + "/long.mp4", "video_too_long"), (host + "/gone.mp4", None)):
                    with pytest.raises(openai.APIStatusError) as info:
                        ask(client, server, url)
                    assert (info.value.status_code, info.value.body["code"]) == ((413, code) if code else (400, None))
            with pytest.raises(openai.APIStatusError) as info:  # over the byte limit: refused before it is opened
                ask(client, server, VIDEO + b"\0" * 64)
            assert info.value.status_code == 413 and info.value.body["code"] == "video_too_large"
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model=server.config.model, max_tokens=1,
                                               messages=messages(video_part(short), video_part(short)))
            assert info.value.body["code"] == "too_many_videos"
    finally:
        server.stop()


def patches_counted(gateway) -> dict[str, float]:
    text = httpx.get(gateway.url + "/metrics", timeout=30).text
    return {s.labels["seen"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "revisit_video_patches" for s in f.samples if s.name.endswith("_total")}


def test_temporal_patches_matched_as_near_duplicates(workers, model_path, tmp_path_factory):
    """REVISIT_VIDEO_MATCH_PATCHES: a later window of a still camera's stream samples other instants (no frame in
    common), and its patches are counted as near-duplicates of the earlier window's, within the caller's
    namespace. The gateway's store is its own (an LMDB environment opens once per process, and the session's
    gateway may hold the shared one): matching needs one."""
    dram = Path(tempfile.mkdtemp(prefix="revisit-patches-", dir="/dev/shm"))
    store = StoreConfig(dram_dir=dram, lmdb_dir=tmp_path_factory.mktemp("patches-lmdb"))
    server = run_gateway(gateway_config(model_path, [w.url for w in workers], store=store,
                                        videos=VideoSettings(match_patches=True)))
    clip = walker("chelsea.png", frames=16, size=(224, 224))
    first, later = encode_video(clip[0:12], fps=4), encode_video(clip[1:13], fps=4)
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="sk-patches", max_retries=0, timeout=300) as client:
            assert ask(client, server, first).headers["x-revisit-video-patches"] == "3;exact=0;approximate=0"
            raw = ask(client, server, later)
            assert seen(raw) == (6, 0, 0)  # not one frame of it was seen before
            assert raw.headers["x-revisit-video-patches"] == "3;exact=0;approximate=3"
            assert ask(client, server, first).headers["x-revisit-video-patches"] == "3;exact=3;approximate=0"
        with openai.OpenAI(base_url=server.url + "/v1", api_key="sk-patches-other", max_retries=0,
                           timeout=300) as other:
            assert ask(other, server, later).headers["x-revisit-video-patches"] == "3;exact=0;approximate=0"
        assert patches_counted(server) == {"exact": 3, "approximate": 3, "miss": 6}
    finally:
        server.stop()
        remove_store_memory(store)


def test_temporal_patches_planned_stored_and_reused_by_the_workers(gateway, model_path, tmp_path):
    """REVISIT_VIDEO_REUSE_PATCHES: each patch of a first window is stored by its worker; the next window of the
    stream (coded losslessly, so its first two patches are the same two frames) reuses those two from the store,
    moved in time; the same window re-coded lossily is a near-duplicate of every patch. A gateway process of its
    own over the session's store (the session's gateway holds the store's LMDB environment in this process)."""
    import subprocess

    from tests.conftest import MODEL_ID, STORE_ENV, free_port, start_gateway_process, worker_events
    from tests.e2e.test_approximate import stop
    from tests.e2e.test_reuse import executed

    port = free_port()
    env = {**STORE_ENV, "REVISIT_MODEL": MODEL_ID, "REVISIT_MODEL_DIR": str(model_path),
           "REVISIT_WORKERS": ",".join(gateway.config.workers), "REVISIT_HEALTH_INTERVAL_S": "0.5",
           "REVISIT_PLAN_BY_COST": "0", "REVISIT_CALIBRATE": "0", "REVISIT_VIDEO_REUSE_PATCHES": "1",
           "REVISIT_VIDEO_MATCH_PATCHES": "1"}
    process: subprocess.Popen = start_gateway_process(env, port, log_file=tmp_path / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    server = type("Server", (), {"url": url, "config": gateway.config})
    frames = walker("chelsea.png", frames=10, size=(224, 224))
    try:
        with openai.OpenAI(base_url=url + "/v1", api_key="sk-patch-reuse", max_retries=0, timeout=300) as client:
            before = worker_events(gateway.config.workers)
            first = ask(client, server, encode_video(frames[0:6], fps=2, lossless=True))
            assert first.headers["x-revisit-video-patches"] == "3;exact=0;approximate=0"
            assert executed(server, before, stored=3)["stored"] == 3
            before = worker_events(gateway.config.workers)
            later = ask(client, server, encode_video(frames[2:8], fps=2, lossless=True))
            assert later.headers["x-revisit-video-patches"].startswith("3;exact=2;")
            assert executed(server, before, exact_executed=2)["exact_executed"] == 2
            assert later.parse().choices[0].message.content
            before = worker_events(gateway.config.workers)
            again = ask(client, server, encode_video(frames[0:6], fps=2))  # lossy: other pixels
            assert again.headers["x-revisit-video-patches"] == "3;exact=0;approximate=3"
            assert executed(server, before, approximate_executed=3)["approximate_executed"] == 3
            assert again.parse().choices[0].message.content
    finally:
        stop(process)
