// Caracal web console: streams a video file or the webcam to a Realtime
// session as JPEG frames and shows what the server does with them.
// Wire: docs/protocol.md (Realtime, live video). No dependencies.
'use strict';

const $ = (id) => document.getElementById(id);

/** Bytes a socket may hold unsent before a frame is skipped instead of queued. */
const MAX_BUFFERED = 4 << 20;
/** Rows kept in the log and answers kept on screen (older ones leave). */
const MAX_ROWS = 400;
const MAX_ANSWERS = 40;
/** The vision tower's patch grid: 14-px patches merged 2×2. */
const QUANTUM = 28;

const el = {
  status: $('status'), sessionId: $('session-id'), model: $('model'), key: $('api-key'),
  connect: $('connect'), disconnect: $('disconnect'), file: $('file'), start: $('start'),
  stop: $('stop'), clear: $('clear'), fps: $('fps'), maxSide: $('max-side'),
  window: $('window'), interval: $('interval'), prompt: $('prompt'), maxTokens: $('max-tokens'),
  tools: $('tools'), toolChoice: $('tool-choice'),
  apply: $('apply'), question: $('question'), ask: $('ask'), video: $('video'),
  answers: $('answers'), log: $('log'),
};

const stats = { sent: 0, skipped: 0, chunks: 0, dropped: 0, tokens: 0, latency: null };
let ws = null;
let stream = null; // the running capture: {source, clock, next, busy, timer, media}
const answers = new Map(); // response id -> {box, text, calls: Map(item id -> element), report}
const canvas = document.createElement('canvas');

function setStatus(state, text) {
  el.status.dataset.state = state;
  el.status.textContent = text;
}

function log(kind, detail, cls) {
  const tr = document.createElement('tr');
  if (cls) tr.className = cls;
  for (const text of [new Date().toLocaleTimeString(), kind, detail]) {
    const td = document.createElement('td');
    td.textContent = text;
    tr.appendChild(td);
  }
  el.log.prepend(tr);
  while (el.log.childElementCount > MAX_ROWS) el.log.lastElementChild.remove();
}

function showStats() {
  $('stat-sent').textContent = stats.sent;
  $('stat-skipped').textContent = stats.skipped;
  $('stat-chunks').textContent = stats.chunks;
  $('stat-dropped').textContent = stats.dropped;
  $('stat-tokens').textContent = stats.tokens;
  $('stat-latency').textContent = stats.latency == null ? '–' : `${stats.latency} ms`;
}

function authHeaders() {
  const key = el.key.value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function loadModels() {
  try {
    const r = await fetch('/v1/models', { headers: authHeaders() });
    if (r.status === 401) {
      el.model.replaceChildren();
      return setStatus('error', 'this server needs its API key');
    }
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    el.model.replaceChildren(...body.data.map((m) => {
      const o = document.createElement('option');
      o.value = m.id;
      o.textContent = m.supports_video ? m.id : `${m.id} (no video)`;
      return o;
    }));
    if (!ws) setStatus('disconnected', 'disconnected');
  } catch (e) {
    setStatus('error', `models: ${e.message}`);
  }
}

function send(event) {
  if (!ws || ws.readyState !== WebSocket.OPEN) return false;
  ws.send(JSON.stringify(event));
  return true;
}

function connected(on) {
  el.connect.disabled = on;
  el.disconnect.disabled = !on;
  el.apply.disabled = !on;
  el.ask.disabled = !on;
  el.clear.disabled = !on;
  el.start.disabled = !on || stream != null;
  el.stop.disabled = stream == null;
}

function connect() {
  const model = el.model.value;
  if (!model) return setStatus('error', 'no model (check the API key)');
  const key = el.key.value.trim();
  const protocols = ['realtime'];
  if (key) protocols.push(`openai-insecure-api-key.${key}`);
  const scheme = location.protocol === 'https:' ? 'wss' : 'ws';
  const url = `${scheme}://${location.host}/v1/realtime?model=${encodeURIComponent(model)}`;
  setStatus('connecting', 'connecting…');
  let socket;
  try {
    socket = new WebSocket(url, protocols);
  } catch (e) {
    return setStatus('error', e.message);
  }
  let opened = false;
  socket.onopen = () => { opened = true; };
  socket.onmessage = (m) => {
    if (typeof m.data !== 'string') return;
    let ev;
    try { ev = JSON.parse(m.data); } catch { return log('error', 'a frame that is not JSON', 'error'); }
    onEvent(ev);
  };
  socket.onclose = (c) => {
    if (ws === socket) ws = null;
    stopStream(false);
    connected(false);
    const why = opened ? `closed (${c.code}${c.reason ? `: ${c.reason}` : ''})`
      : 'refused (check the API key; the origin must be this server or in --allowed-origins)';
    setStatus(opened ? 'disconnected' : 'error', why);
    log('socket', why, opened ? '' : 'error');
  };
  ws = socket;
}

/** The session's video settings from the form; `withStream` adds what a running stream may not change. */
function videoSettings(withStream) {
  const num = (input, fallback) => {
    const v = parseFloat(input.value);
    return Number.isFinite(v) ? v : fallback;
  };
  const video = {
    window_seconds: Math.max(0, num(el.window, 120)),
    analysis_interval: el.interval.value.trim() === '' ? null : Math.max(0.5, num(el.interval, 10)),
    analysis_prompt: el.prompt.value,
  };
  if (withStream) {
    video.fps = Math.min(30, Math.max(0.1, num(el.fps, 2)));
    video.format = 'jpeg';
  }
  return video;
}

function sessionUpdate() {
  const tokens = Math.round(parseFloat(el.maxTokens.value));
  const session = {
    type: 'realtime',
    max_output_tokens: Number.isFinite(tokens) && tokens > 0 ? tokens : 128,
    video: videoSettings(stream == null),
  };
  const tools = el.tools.value.trim();
  try {
    session.tools = tools ? JSON.parse(tools) : [];
    session.tool_choice = session.tools.length ? el.toolChoice.value : 'auto';
  } catch (e) {
    log('error', `tools: not JSON (${e.message})`, 'error');
  }
  send({ type: 'session.update', session });
}

function ask() {
  const text = el.question.value.trim();
  if (!text) return;
  send({
    type: 'conversation.item.create',
    item: { type: 'message', role: 'user', content: [{ type: 'input_text', text }] },
  });
  send({ type: 'response.create' });
}

// ---- capture ------------------------------------------------------------

/** The frame size sent: the longest side at most `max-side`, both sides multiples of 28. */
function frameSize(w, h) {
  const maxSide = Math.min(896, Math.max(QUANTUM, parseFloat(el.maxSide.value) || 448));
  const scale = Math.min(1, maxSide / Math.max(w, h));
  const snap = (x) => Math.max(QUANTUM, Math.floor((x * scale) / QUANTUM) * QUANTUM);
  return [snap(w), snap(h)];
}

function blobToBase64(blob) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result.slice(r.result.indexOf(',') + 1));
    r.onerror = () => reject(r.error);
    r.readAsDataURL(blob);
  });
}

async function capture(s, t) {
  s.busy = true;
  try {
    const v = el.video;
    if (!v.videoWidth) return;
    const [w, h] = frameSize(v.videoWidth, v.videoHeight);
    canvas.width = w;
    canvas.height = h;
    canvas.getContext('2d').drawImage(v, 0, 0, w, h);
    const blob = await new Promise((resolve) => canvas.toBlob(resolve, 'image/jpeg', 0.85));
    if (!blob || stream !== s) return;
    const video = await blobToBase64(blob);
    if (send({ type: 'input_video_buffer.append', video, timestamp_ms: Math.round(t) })) {
      stats.sent += 1;
      showStats();
    }
  } catch (e) {
    log('error', `capture: ${e.message}`, 'error');
  } finally {
    s.busy = false;
  }
}

function tick(s) {
  if (stream !== s || s.busy || el.video.paused || el.video.readyState < 2) return;
  const t = s.clock();
  if (t < s.next) return;
  const period = 1000 / s.fps;
  s.next += period;
  if (s.next <= t) s.next = t + period; // fell behind (a hidden tab): no burst
  if (ws && ws.bufferedAmount > MAX_BUFFERED) {
    stats.skipped += 1;
    return showStats();
  }
  capture(s, t);
}

async function startStream() {
  if (stream || !ws) return;
  const source = document.querySelector('input[name="source"]:checked').value;
  const v = el.video;
  let media = null;
  let clock;
  try {
    if (source === 'file') {
      const f = el.file.files[0];
      if (!f) return log('error', 'pick a video file first', 'error');
      v.srcObject = null;
      v.removeAttribute('poster');
      if (v.src) URL.revokeObjectURL(v.src);
      v.src = URL.createObjectURL(f);
      v.loop = false;
      clock = () => v.currentTime * 1000;
    } else {
      media = await navigator.mediaDevices.getUserMedia({
        video: { width: { ideal: 1280 }, height: { ideal: 720 } }, audio: false,
      });
      v.removeAttribute('src');
      v.removeAttribute('poster');
      v.srcObject = media;
      const t0 = performance.now();
      clock = () => performance.now() - t0;
    }
    await v.play();
  } catch (e) {
    if (media) media.getTracks().forEach((track) => track.stop());
    return log('error', `${source}: ${e.message}`, 'error');
  }
  const fps = Math.min(30, Math.max(0.1, parseFloat(el.fps.value) || 2));
  sessionUpdate(); // fps and format go out before the stream's first frame
  const s = { source, clock, fps, next: clock(), busy: false, media, timer: 0 };
  s.timer = setInterval(() => tick(s), Math.max(10, Math.min(50, 250 / fps)));
  stream = s;
  el.fps.disabled = true;
  connected(true);
  log('stream', `${source === 'file' ? el.file.files[0].name : 'webcam'} at ${fps} fps`);
}

/** Stops capturing; `commit` ends the stream on the server too. */
function stopStream(commit) {
  const s = stream;
  if (!s) return;
  stream = null;
  clearInterval(s.timer);
  if (s.media) {
    // The camera goes dark when its tracks stop: keep the last frame sent on screen.
    if (canvas.width) el.video.poster = canvas.toDataURL('image/jpeg');
    s.media.getTracks().forEach((track) => track.stop());
    el.video.srcObject = null;
  }
  el.video.pause();
  el.fps.disabled = false;
  if (commit) send({ type: 'input_video_buffer.commit' });
  connected(ws != null);
}

// ---- server events ------------------------------------------------------

function answerFor(id, response) {
  let a = answers.get(id);
  if (a) return a;
  const box = document.createElement('div');
  box.className = 'answer';
  const meta = document.createElement('div');
  meta.className = 'meta';
  const cadence = response && response.metadata && response.metadata.caracal_analysis === 'cadence';
  const tag = document.createElement('span');
  tag.className = 'tag';
  tag.textContent = cadence ? 'cadence' : 'question';
  const info = document.createElement('span');
  info.textContent = 'generating…';
  meta.append(tag, info);
  const text = document.createElement('div');
  text.className = 'text';
  box.append(meta, text);
  el.answers.prepend(box);
  while (el.answers.childElementCount > MAX_ANSWERS) el.answers.lastElementChild.remove();
  a = { box, text, info, calls: new Map(), report: null };
  answers.set(id, a);
  if (answers.size > MAX_ANSWERS) answers.delete(answers.keys().next().value);
  return a;
}

function toolCall(a, itemId, name) {
  let call = a.calls.get(itemId);
  if (!call) {
    call = document.createElement('div');
    call.className = 'call';
    call.dataset.name = name || 'tool';
    call.textContent = `${call.dataset.name}(`;
    a.box.appendChild(call);
    a.calls.set(itemId, call);
  }
  return call;
}

function onEvent(ev) {
  switch (ev.type) {
    case 'session.created':
      setStatus('connected', 'connected');
      el.sessionId.textContent = ev.session.id;
      connected(true);
      log('session', `created (${ev.session.model})`);
      sessionUpdate();
      break;
    case 'session.updated': {
      const v = ev.session.video;
      log('session', v ? `updated: ${v.fps} fps, window ${v.window_seconds} s, analysis ${v.analysis_interval == null ? 'off' : `every ${v.analysis_interval} s`}` : 'updated');
      break;
    }
    case 'input_video_buffer.chunk_added':
      stats.chunks += 1;
      stats.tokens += ev.tokens;
      stats.latency = Math.round(ev.latency_ms);
      log('chunk', `#${ev.chunk_index} · frame ${ev.frame_index} · ${ev.frames} frames · ${ev.timestamp} · ${ev.tokens} tokens · ${stats.latency} ms`, 'chunk');
      showStats();
      break;
    case 'input_video_buffer.frames_dropped':
      stats.dropped += ev.count;
      log('dropped', `${ev.count} frames ${Math.round(ev.first_ms)}–${Math.round(ev.last_ms)} ms (${ev.reason})`, 'drop');
      showStats();
      break;
    case 'input_video_buffer.window_evicted':
      stats.tokens = Math.max(0, stats.tokens - ev.tokens);
      log('evicted', `chunks ${ev.first_chunk_index}–${ev.last_chunk_index} · ${ev.tokens} tokens · ${ev.pages_released} pages`, 'evict');
      showStats();
      break;
    case 'input_video_buffer.committed':
      log('stream', 'committed');
      break;
    case 'input_video_buffer.cleared':
      stats.tokens = 0;
      log('stream', 'cleared');
      showStats();
      break;
    case 'response.created':
      answerFor(ev.response.id, ev.response);
      break;
    case 'response.output_item.added':
      if (ev.item.type === 'function_call') toolCall(answerFor(ev.response_id), ev.item.id, ev.item.name);
      break;
    case 'response.output_text.delta':
      answerFor(ev.response_id).text.textContent += ev.delta;
      break;
    case 'response.function_call_arguments.delta':
      toolCall(answerFor(ev.response_id), ev.item_id).textContent += ev.delta;
      break;
    case 'response.function_call_arguments.done':
      toolCall(answerFor(ev.response_id), ev.item_id).textContent += ')';
      break;
    case 'caracal.cache_report':
      answerFor(ev.response_id).report = ev;
      break;
    case 'response.done': {
      const r = ev.response;
      const a = answerFor(r.id, r);
      const u = r.usage || {};
      const cached = u.input_token_details ? u.input_token_details.cached_tokens : 0;
      const shown = a.text.textContent || a.calls.size ? '' : ' · no visible text (reasoning is not streamed)';
      a.info.textContent = `${r.status} · ${u.input_tokens || 0} in (${cached || 0} cached) · ${u.output_tokens || 0} out${shown}`;
      a.box.dataset.done = r.status;
      break;
    }
    case 'error': {
      const e = ev.error || {};
      log('error', `${e.code || e.type}: ${e.message}`, 'error');
      break;
    }
    default:
      break;
  }
}

// ---- wiring -------------------------------------------------------------

el.connect.addEventListener('click', connect);
el.disconnect.addEventListener('click', () => { if (ws) ws.close(1000, 'closed by the console'); });
el.start.addEventListener('click', startStream);
el.stop.addEventListener('click', () => stopStream(true));
el.clear.addEventListener('click', () => {
  stopStream(false);
  send({ type: 'input_video_buffer.clear' });
});
el.apply.addEventListener('click', sessionUpdate);
el.ask.addEventListener('click', ask);
el.question.addEventListener('keydown', (e) => {
  if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) ask();
});
el.key.addEventListener('change', loadModels);
el.video.addEventListener('ended', () => {
  if (stream && stream.source === 'file') {
    log('stream', 'end of file');
    stopStream(true);
  }
});
window.addEventListener('beforeunload', () => stopStream(false));
showStats();
loadModels();
