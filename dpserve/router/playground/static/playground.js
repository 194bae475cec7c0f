// The dpserve playground: plain JavaScript over the router's public API (docs/router.md).
// What happens is left in the DOM and as performance marks, so a person (or a test) can
// read it: each section's data-state, each stream event as a list item with its time.
"use strict";

(() => {
  const KEY = "dpserve.apiKey"; // sessionStorage: gone when the tab closes
  const POLL_MS = 500;
  const PAINT = "#ff2d8a";
  const $ = (id) => document.getElementById(id);
  const state = { features: null, router: null, generated: null, source: null, urls: {} };

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  // ------------------------------------------------------------------ the API

  function headers(extra) {
    const all = new Headers(extra || {});
    const key = sessionStorage.getItem(KEY);
    if (key) all.set("Authorization", `Bearer ${key}`);
    return all;
  }

  async function failure(response) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_) {
      // not JSON: the status line says what there is to say
    }
    return new ApiError(response.status, message);
  }

  async function api(path, init = {}) {
    const response = await fetch(path, { ...init, headers: headers(init.headers) });
    if (!response.ok) throw await failure(response);
    return response;
  }

  // Server-Sent Events from a fetch body (EventSource cannot POST or send a key).
  async function* events(response) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data) yield JSON.parse(data);
      }
    }
  }

  // ------------------------------------------------------------------ page state

  function showError(error) {
    const box = $("error");
    box.textContent = error.status ? `${error.status}: ${error.message}` : String(error.message);
    box.hidden = false;
    if (error.status === 401) $("key-form").hidden = false;
  }

  function clearError() {
    $("error").hidden = true;
  }

  function maxPreviews() {
    return Math.min(state.features.partial_images || 0, state.router.max_partial_images || 0);
  }

  function has(feature) {
    const f = state.features;
    switch (feature) {
      case "images":
        return !f.video;
      case "video":
        return Boolean(f.video);
      case "previews":
        return maxPreviews() > 0;
      case "edits":
        return !f.video && Boolean(f.edits);
      case "inpainting":
        return Boolean(f.inpainting);
      case "image_to_video":
        return Boolean(f.video && f.video.image_to_video);
      default:
        return false;
    }
  }

  function applyFeatures() {
    for (const el of document.querySelectorAll("[data-needs]")) {
      el.hidden = !has(el.dataset.needs);
    }
    for (const input of document.querySelectorAll('input[name="previews"]')) {
      input.max = maxPreviews();
      input.value = Math.min(Number(input.value), maxPreviews());
    }
    const reference = document.querySelector('#video-form input[name="input_reference"]');
    reference.required = has("video") && !state.features.video.text_to_video;
    const parts = [];
    if (has("images")) parts.push(has("previews") ? "images with previews" : "images");
    if (has("edits")) parts.push(has("inpainting") ? "edits with a mask" : "edits");
    if (has("video")) parts.push(has("image_to_video") ? "videos from an image" : "videos");
    $("status").textContent = `This server makes ${parts.join(", ")}.`;
  }

  async function boot() {
    clearError();
    let models;
    try {
      models = await (await api("/v1/models")).json();
    } catch (error) {
      const keyed = error.status === 401;
      $("status").textContent = keyed ? "This server needs an API key." : "No answer yet.";
      showError(error);
      if (!keyed && error.status !== 403) setTimeout(boot, 2000);
      return;
    }
    const model = models.data[0];
    $("model").textContent = model.id;
    $("key-form").hidden = true;
    if (!model.features) {
      $("status").textContent = "No replica is serving yet; asking again in 2 s.";
      setTimeout(boot, 2000);
      return;
    }
    state.features = model.features;
    state.router = model.router_features;
    applyFeatures();
    document.body.dataset.ready = "true";
  }

  // ------------------------------------------------------------------ helpers

  function field(form, name) {
    const input = form.elements[name];
    return input && !input.closest("[hidden]") ? input.value.trim() : "";
  }

  function numberField(form, name) {
    const value = field(form, name);
    return value === "" ? undefined : Number(value);
  }

  function dataUrl(event) {
    return `data:image/${event.output_format};base64,${event.b64_json}`;
  }

  function blobOf(b64, type) {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    return new Blob([bytes], { type });
  }

  function keepUrl(name, blob) {
    if (state.urls[name]) URL.revokeObjectURL(state.urls[name]);
    state.urls[name] = URL.createObjectURL(blob);
    return state.urls[name];
  }

  function logEvent(list, type, text, ms) {
    const item = document.createElement("li");
    item.dataset.type = type;
    item.dataset.ms = ms.toFixed(1);
    item.textContent = `${text} at ${Math.round(ms)} ms`;
    list.append(item);
  }

  function caption(event, extra) {
    const parts = [`seed ${event.seed}`, event.size];
    if (typeof event.inference_time_s === "number") {
      parts.push(`${event.inference_time_s.toFixed(2)} s on the model`);
    }
    return [...parts, ...(extra || [])].join(" · ");
  }

  // One streamed image request (a generation or an edit): previews, then the image.
  async function runImage(name, path, init, show) {
    const section = $(name);
    const list = $(`${name}-events`);
    const button = section.querySelector('button[type="submit"]');
    list.replaceChildren();
    clearError();
    section.dataset.state = "running";
    button.disabled = true;
    performance.mark(`${name}:start`);
    const start = performance.now();
    let previews = 0;
    try {
      for await (const event of events(await api(path, init))) {
        const ms = performance.now() - start;
        if (event.type.endsWith(".partial_image")) {
          if (previews++ === 0) performance.mark(`${name}:first-preview`);
          const step = typeof event.step === "number" ? ` after step ${event.step + 1}/${event.steps}` : "";
          logEvent(list, "preview", `preview ${event.partial_image_index + 1}${step}`, ms);
          await show(event, false);
        } else if (event.type.endsWith(".completed")) {
          performance.mark(`${name}:image`);
          logEvent(list, "image", "image", ms);
          await show(event, true);
        } else if (event.type === "error") {
          throw new ApiError(null, event.error.message);
        }
      }
      section.dataset.state = "done";
    } catch (error) {
      section.dataset.state = "failed";
      showError(error);
    } finally {
      button.disabled = false;
    }
  }

  // ------------------------------------------------------------------ generate

  async function generate(submit) {
    submit.preventDefault();
    const form = submit.target;
    const body = { prompt: field(form, "prompt"), stream: true };
    body.partial_images = numberField(form, "previews") || 0;
    const size = field(form, "size");
    if (size) body.size = size;
    const steps = numberField(form, "steps");
    if (steps !== undefined) body.num_inference_steps = steps;
    const seed = numberField(form, "seed");
    if (seed !== undefined) body.seed = seed;
    const image = $("generate-image");
    const init = { method: "POST", body: JSON.stringify(body) };
    init.headers = { "Content-Type": "application/json" };
    $("to-edit").hidden = true;
    await runImage("generate", "/v1/images/generations", init, (event, final) => {
      image.src = dataUrl(event);
      image.dataset.kind = final ? "image" : "preview";
      image.hidden = false;
      if (final) {
        state.generated = { b64: event.b64_json, type: `image/${event.output_format}` };
        $("generate-caption").textContent = caption(event);
        $("to-edit").hidden = !has("edits");
      } else {
        $("generate-caption").textContent = `preview ${event.partial_image_index + 1}`;
      }
    });
  }

  // ------------------------------------------------------------------ edit

  const mask = { canvas: null, painting: false, last: null, painted: false };

  function setSource(blob) {
    state.source = blob;
    $("edit-source").src = keepUrl("source", blob);
    $("source-view").hidden = false;
  }

  function resetMask() {
    const canvas = mask.canvas;
    const source = $("edit-source");
    canvas.width = source.naturalWidth;
    canvas.height = source.naturalHeight;
    mask.painted = false;
    const brush = document.querySelector('#edit-form input[name="brush"]');
    brush.max = Math.max(8, Math.round(canvas.width / 4));
    brush.value = Math.max(1, Math.round(canvas.width / 16));
  }

  function canvasPoint(pointer) {
    const box = mask.canvas.getBoundingClientRect();
    return {
      x: ((pointer.clientX - box.left) * mask.canvas.width) / box.width,
      y: ((pointer.clientY - box.top) * mask.canvas.height) / box.height,
    };
  }

  function stroke(to) {
    const ctx = mask.canvas.getContext("2d");
    const from = mask.last || to;
    ctx.strokeStyle = PAINT;
    ctx.lineCap = "round";
    ctx.lineJoin = "round";
    ctx.lineWidth = 2 * Number(document.querySelector('#edit-form input[name="brush"]').value);
    ctx.beginPath();
    ctx.moveTo(from.x, from.y);
    ctx.lineTo(to.x, to.y);
    ctx.stroke();
    mask.last = to;
    mask.painted = true;
  }

  function watchPainting() {
    const canvas = mask.canvas;
    canvas.addEventListener("pointerdown", (pointer) => {
      if (!has("inpainting")) return;
      canvas.setPointerCapture(pointer.pointerId);
      mask.painting = true;
      mask.last = null;
      stroke(canvasPoint(pointer));
    });
    canvas.addEventListener("pointermove", (pointer) => {
      if (mask.painting) stroke(canvasPoint(pointer));
    });
    for (const end of ["pointerup", "pointercancel"]) {
      canvas.addEventListener(end, () => {
        mask.painting = false;
        mask.last = null;
      });
    }
  }

  // Painted pixels (any paint at all) as a boolean per pixel.
  function paintedPixels() {
    const { width, height } = mask.canvas;
    const paint = mask.canvas.getContext("2d").getImageData(0, 0, width, height).data;
    const painted = new Uint8Array(width * height);
    for (let i = 0; i < painted.length; i++) painted[i] = paint[4 * i + 3] > 0 ? 1 : 0;
    return painted;
  }

  // OpenAI's mask convention: transparent where to repaint, opaque where to keep.
  async function maskPng(painted) {
    const { width, height } = mask.canvas;
    const out = new OffscreenCanvas(width, height);
    const ctx = out.getContext("2d");
    const pixels = ctx.createImageData(width, height);
    for (let i = 0; i < painted.length; i++) pixels.data[4 * i + 3] = painted[i] ? 0 : 255;
    ctx.putImageData(pixels, 0, 0);
    return out.convertToBlob({ type: "image/png" });
  }

  async function pixelsOf(blob) {
    const bitmap = await createImageBitmap(blob, {
      colorSpaceConversion: "none",
      premultiplyAlpha: "none",
    });
    const canvas = new OffscreenCanvas(bitmap.width, bitmap.height);
    const ctx = canvas.getContext("2d");
    ctx.drawImage(bitmap, 0, 0);
    return { canvas, ctx, data: ctx.getImageData(0, 0, bitmap.width, bitmap.height) };
  }

  // The model's pixels inside the mask, the source's outside it (an inpainting pipeline
  // decodes the whole image again, so its own answer differs outside the mask too).
  async function pasteBack(editedBlob, painted) {
    const source = await pixelsOf(state.source);
    const edited = await pixelsOf(editedBlob);
    if (source.data.width !== edited.data.width || source.data.height !== edited.data.height) {
      return null;
    }
    const out = source.data.data;
    const model = edited.data.data;
    for (let i = 0; i < painted.length; i++) {
      if (painted[i]) for (let c = 0; c < 4; c++) out[4 * i + c] = model[4 * i + c];
    }
    source.ctx.putImageData(source.data, 0, 0);
    return source.canvas.convertToBlob({ type: "image/png" });
  }

  async function edit(submit) {
    submit.preventDefault();
    const form = submit.target;
    if (!state.source) {
      showError(new ApiError(null, "choose an image to edit first (or generate one)"));
      return;
    }
    const masked = has("inpainting") && mask.painted;
    const painted = masked ? paintedPixels() : null;
    const body = new FormData();
    body.append("image", state.source, state.source.name || "image.png");
    if (masked) {
      const png = await maskPng(painted);
      body.append("mask", png, "mask.png");
      $("edit-mask").href = keepUrl("mask", png);
    }
    body.append("prompt", field(form, "prompt"));
    body.append("stream", "true");
    body.append("partial_images", String(numberField(form, "previews") || 0));
    for (const [name, key] of [
      ["steps", "num_inference_steps"],
      ["seed", "seed"],
      ["strength", "strength"],
    ]) {
      const value = field(form, name);
      if (value !== "") body.append(key, value);
    }
    const paste = masked && form.elements.paste.checked;
    const image = $("edit-image");
    $("edit-links").hidden = true;
    await runImage("edit", "/v1/images/edits", { method: "POST", body }, async (event, final) => {
      const raw = blobOf(event.b64_json, `image/${event.output_format}`);
      const shown = paste ? await pasteBack(raw, painted) : null;
      image.src = keepUrl(final ? "edited" : "edit-preview", shown || raw);
      image.dataset.kind = final ? "image" : "preview";
      image.dataset.pasted = String(Boolean(shown));
      image.hidden = false;
      if (!final) {
        $("edit-caption").textContent = `preview ${event.partial_image_index + 1}`;
        return;
      }
      const notes = [];
      if (shown) notes.push("outside the mask: the source's pixels");
      if (paste && !shown) notes.push("not the source's size, so shown as the model made it");
      $("edit-caption").textContent = caption(event, notes);
      $("edit-shown").href = image.src;
      $("edit-raw").href = keepUrl("raw", raw);
      $("edit-mask-link").hidden = !masked;
      $("edit-links").hidden = false;
    });
  }

  // ------------------------------------------------------------------ video

  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  const ENDED = new Set(["completed", "failed", "cancelled"]);

  function videoBody(form) {
    const fields = { prompt: field(form, "prompt") };
    const size = field(form, "size");
    if (size) fields.size = size;
    const seconds = field(form, "seconds");
    if (seconds) fields.seconds = seconds;
    const steps = numberField(form, "steps");
    if (steps !== undefined) fields.num_inference_steps = steps;
    const seed = numberField(form, "seed");
    if (seed !== undefined) fields.seed = seed;
    const reference = form.elements.input_reference;
    if (!has("image_to_video") || reference.files.length === 0) {
      return { body: JSON.stringify(fields), headers: { "Content-Type": "application/json" } };
    }
    const body = new FormData();
    for (const [name, value] of Object.entries(fields)) body.append(name, String(value));
    body.append("input_reference", reference.files[0]);
    return { body };
  }

  function showJob(job) {
    $("video-progress").value = job.progress || 0;
    const extra = job.status === "completed" ? ` · ${job.size}, ${job.seconds} s` : "";
    $("video-status").textContent = `${job.status} · ${job.progress || 0} %${extra}`;
    $("video").dataset.state = job.status;
  }

  async function poll(id) {
    for (;;) {
      await sleep(POLL_MS);
      try {
        const job = await (await api(`/v1/videos/${encodeURIComponent(id)}`)).json();
        showJob(job);
        if (ENDED.has(job.status)) return job;
      } catch (error) {
        // 503: the job's owner is being replaced; ask again. Anything else ends it.
        if (error.status !== 503) throw error;
        $("video-status").textContent = error.message;
      }
    }
  }

  async function play(job) {
    const player = $("video-player");
    const content = `/v1/videos/${encodeURIComponent(job.id)}/content`;
    const [video, thumbnail] = await Promise.all([
      api(content).then((r) => r.blob()),
      api(`${content}?variant=thumbnail`).then((r) => r.blob()),
    ]);
    player.poster = keepUrl("poster", thumbnail);
    player.src = keepUrl("video", video);
    const link = $("video-download");
    link.href = state.urls.video;
    link.download = `${job.id.split(".")[0]}.mp4`;
    $("video-links").hidden = false;
    player.hidden = false;
    player.play().catch(() => {}); // muted, so allowed; the controls remain if not
  }

  async function video(submit) {
    submit.preventDefault();
    const form = submit.target;
    const button = form.querySelector('button[type="submit"]');
    clearError();
    button.disabled = true;
    $("video-player").hidden = true;
    $("video-links").hidden = true;
    performance.mark("video:start");
    try {
      const request = videoBody(form);
      const job = await (await api("/v1/videos", { method: "POST", ...request })).json();
      showJob(job);
      const ended = ENDED.has(job.status) ? job : await poll(job.id);
      performance.mark("video:ended");
      if (ended.status === "completed") await play(ended);
      else if (ended.error) throw new ApiError(null, ended.error.message);
    } catch (error) {
      $("video").dataset.state = "failed";
      showError(error);
    } finally {
      button.disabled = false;
    }
  }

  function watchPlayer() {
    const player = $("video-player");
    player.addEventListener("loadedmetadata", () => {
      player.dataset.duration = String(player.duration);
    });
    player.addEventListener("playing", () => {
      performance.mark("video:playing");
      player.dataset.playing = "true";
    });
    player.addEventListener("error", () => {
      const problem = player.error ? player.error.message || `code ${player.error.code}` : "";
      player.dataset.error = problem;
      showError(new ApiError(null, `this browser cannot play the video (${problem}); download it`));
    });
  }

  // ------------------------------------------------------------------ start

  document.addEventListener("DOMContentLoaded", () => {
    mask.canvas = $("mask-canvas");
    $("edit-source").addEventListener("load", resetMask);
    watchPainting();
    watchPlayer();
    $("clear-mask").addEventListener("click", resetMask);
    $("generate-form").addEventListener("submit", generate);
    $("edit-form").addEventListener("submit", edit);
    $("video-form").addEventListener("submit", video);
    document.querySelector('#edit-form input[name="image"]').addEventListener("change", (e) => {
      if (e.target.files.length) setSource(e.target.files[0]);
    });
    $("to-edit").addEventListener("click", () => {
      setSource(blobOf(state.generated.b64, state.generated.type));
      $("edit").scrollIntoView();
    });
    $("key-form").addEventListener("submit", (submit) => {
      submit.preventDefault();
      sessionStorage.setItem(KEY, $("key").value.trim());
      $("key").value = "";
      boot();
    });
    boot();
  });
})();
