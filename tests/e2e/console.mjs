// The web console in headless Chromium (playwright-core), against a running
// `caracal serve`: connect (API key as the WebSocket subprotocol), a video
// file picked with setInputFiles and streamed, the webcam path fed by
// Chromium's fake capture device from a .y4m clip, a question and its
// streamed answer, and no page errors. Driven by tests/e2e_console.rs.
//
// Env: CONSOLE_URL (http://127.0.0.1:PORT/), CONSOLE_CLIP (a video file),
// CONSOLE_Y4M (the fake camera's clip), CONSOLE_API_KEY (optional),
// CHROMIUM (default /usr/bin/chromium), PLAYWRIGHT_CORE (the package folder),
// CONSOLE_SCREENSHOT (optional PNG path).

import { createRequire } from 'node:module';
import assert from 'node:assert/strict';

const env = (name, fallback) => {
  const v = process.env[name] ?? fallback;
  if (v === undefined) throw new Error(`${name} is not set`);
  return v;
};
const require = createRequire(import.meta.url);
const { chromium } = require(env('PLAYWRIGHT_CORE'));

const url = env('CONSOLE_URL');
const clip = env('CONSOLE_CLIP');
const y4m = env('CONSOLE_Y4M');
const key = env('CONSOLE_API_KEY', '');
const screenshot = env('CONSOLE_SCREENSHOT', '');
const TIMEOUT = 180_000;

const step = (what) => console.log(`console e2e: ${what}`);

const browser = await chromium.launch({
  executablePath: env('CHROMIUM', '/usr/bin/chromium'),
  args: [
    '--no-sandbox',
    '--use-fake-ui-for-media-stream',
    '--use-fake-device-for-media-stream',
    `--use-file-for-fake-video-capture=${y4m}`,
    '--autoplay-policy=no-user-gesture-required',
  ],
});
const errors = [];
const TEXT_URL = env('CONSOLE_TEXT_URL', '');

/** Opens the console at `base` in a new page; records its socket traffic. */
async function open(base, apiKey) {
  const page = await context.newPage();
  page.setDefaultTimeout(TIMEOUT);
  page.on('pageerror', (e) => errors.push(`page error: ${e.message}`));
  page.on('console', (m) => {
    if (m.type() === 'error') errors.push(`console error: ${m.text()}`);
  });
  // What went over the console's socket, parsed: server events and client events.
  const received = [];
  const sent = [];
  page.on('websocket', (ws) => {
    ws.on('framereceived', (f) => {
      try { received.push(JSON.parse(f.payload)); } catch { errors.push('server sent a non-JSON frame'); }
    });
    ws.on('framesent', (f) => {
      try { sent.push(JSON.parse(f.payload)); } catch { errors.push('console sent a non-JSON frame'); }
    });
  });
  const resp = await page.goto(base);
  assert.equal(resp.status(), 200);
  if (apiKey) {
    // Before the key is typed the page's /v1/models answers 401 (the
    // browser logs it); the console asks for the key.
    await page.waitForSelector('#status >> text=needs its API key');
    const i = errors.findIndex((e) => e.includes('status of 401'));
    if (i >= 0) errors.splice(i, 1);
    await page.fill('#api-key', apiKey);
    await page.dispatchEvent('#api-key', 'change');
  }
  await page.waitForFunction(() => document.querySelector('#model').options.length > 0);
  await page.click('#connect');
  await page.waitForSelector('#status[data-state="connected"]');
  const created = received.find((e) => e.type === 'session.created');
  assert.ok(created, 'session.created');
  const waitFor = async (what, pred, ms = TIMEOUT) => {
    const end = Date.now() + ms;
    for (;;) {
      const hit = pred();
      if (hit) return hit;
      if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
      await page.waitForTimeout(100);
    }
  };
  await waitFor('session.updated', () => received.find((e) => e.type === 'session.updated'));
  return { page, received, sent, created, waitFor };
}

/** Asks a question in the console and waits for its response.done. */
async function ask(c, question) {
  const before = c.received.filter((e) => e.type === 'response.done').length;
  await c.page.fill('#question', question);
  await c.page.click('#ask');
  const done = await c.waitFor('response.done', () => c.received.filter((e) => e.type === 'response.done')[before]);
  await c.page.waitForSelector('#answers .answer[data-done]');
  // The random-weight models write until the budget: `incomplete` is their normal end.
  assert.ok(['completed', 'incomplete'].includes(done.response.status), JSON.stringify(done.response.status_details));
  const info = await c.page.textContent('#answers .answer .meta');
  assert.match(info, /(completed|incomplete) · \d+ in \(\d+ cached\) · \d+ out/);
  const deltas = c.received
    .filter((e) => e.type === 'response.output_text.delta' && e.response_id === done.response.id)
    .map((e) => e.delta)
    .join('');
  assert.equal(await c.page.textContent('#answers .answer .text'), deltas, 'the console shows the streamed text');
  return deltas;
}

const context = await browser.newContext({ viewport: { width: 1440, height: 900 } });
try {
  step('open the console and connect (the key as the subprotocol)');
  const c = await open(url, key);
  const { page, received, sent, created, waitFor } = c;
  const stat = async (id) => Number(await page.textContent(`#stat-${id}`));
  const appends = () => sent.filter((e) => e.type === 'input_video_buffer.append');
  const update = sent.find((e) => e.type === 'session.update');
  assert.equal(update.session.max_output_tokens, 128);
  assert.equal(update.session.video.window_seconds, 120);
  // The live-video server echoes the effective settings as session.video.
  const live = created.session.video !== undefined;
  if (!live) step('note: this server echoes no session.video, so no chunk_added rows are checked');

  step('stream a video file');
  await page.fill('#fps', '4');
  await page.setInputFiles('#file', clip);
  await page.click('#start');
  await page.waitForSelector('#log tr >> text=end of file');
  const fileFrames = appends();
  // 3 s of media at 4 fps: 12 frames, give or take one for where play starts
  // and stops; a loaded machine may skip a few ticks (never more than 12 + 1).
  assert.ok(fileFrames.length >= 9 && fileFrames.length <= 13, `file frames sent: ${fileFrames.length}`);
  const times = fileFrames.map((e) => e.timestamp_ms);
  for (let i = 1; i < times.length; i += 1) assert.ok(times[i] > times[i - 1], `timestamps increase: ${times}`);
  assert.ok(times[times.length - 1] >= 2000, `the file's media time reaches its end: ${times}`);
  for (const e of fileFrames) assert.ok(e.video.startsWith('/9j/'), 'each append is a base64 JPEG');
  assert.ok(sent.some((e) => e.type === 'input_video_buffer.commit'), 'the end of the file commits the stream');
  assert.equal(await stat('sent'), fileFrames.length);
  const fileUpdate = sent.filter((e) => e.type === 'session.update').at(-1);
  assert.equal(fileUpdate.session.video.fps, 4);
  assert.equal(fileUpdate.session.video.format, 'jpeg');
  if (live) await page.waitForSelector('#log tr.chunk');

  step('stream the webcam (fake capture from the .y4m clip)');
  await page.fill('#fps', '2');
  await page.check('input[name="source"][value="camera"]');
  await page.click('#start');
  await waitFor('webcam frames', () => appends().length >= fileFrames.length + 4);
  await page.click('#stop');
  const camFrames = appends().slice(fileFrames.length);
  for (const e of camFrames) assert.ok(e.video.startsWith('/9j/'), 'each append is a base64 JPEG');
  const camTimes = camFrames.map((e) => e.timestamp_ms);
  for (let i = 1; i < camTimes.length; i += 1) assert.ok(camTimes[i] > camTimes[i - 1], `timestamps increase: ${camTimes}`);
  if (live) {
    await waitFor('chunk rows of both streams', () => received.filter((e) => e.type === 'input_video_buffer.chunk_added').length >= 2);
  }

  step('ask a question');
  await ask(c, 'What is happening in the video?');
  if (screenshot) {
    await page.screenshot({ path: screenshot, fullPage: true });
    step(`screenshot in ${screenshot}`);
  }
  step(`${appends().length} frames sent, ${received.length} server events`);

  if (TEXT_URL) {
    // The default model thinks until its budget and Realtime shows no
    // reasoning; a model without a thinking format streams its text.
    step('a text model streams its answer');
    const t = await open(TEXT_URL, '');
    const text = await ask(t, 'Say something.');
    assert.ok(text.length > 0, 'the answer streamed text');
    step(`answer: ${JSON.stringify(text.slice(0, 80))}`);
  }
} finally {
  await browser.close();
}
assert.deepEqual(errors, [], 'no page errors');
step('passed');
