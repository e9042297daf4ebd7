// load.mjs — the load/consistency client of tests/integration/test_api.sh (Node 20, no packages:
// global fetch + AbortController).
//
//   node load.mjs greedy URL OUT.json [alone|crowd]
//       runs the fixed greedy request set (completions and chat, shared prefixes, a long prompt)
//       one at a time ("alone") or all at once among 24 sampled filler requests ("crowd", 32 in
//       flight), and writes {name: text} to OUT.json for byte comparison across servers.
//   node load.mjs soak URL N CONCURRENCY
//       N mixed requests (stream / non-stream, chat / completions, random lengths) from
//       CONCURRENCY workers; every 7th streaming request disconnects after its first content
//       chunk. Checks the shape of every finished response; exits 1 on any unexpected result.
//   node load.mjs idle URL N
//       opens N idle TCP connections (half of them with a half-sent request) plus 16 streaming
//       requests that stay open, then checks that a completion is still served promptly.
//   node load.mjs burst URL N BODY_JSON
//       fires N copies of one request at once and prints one HTTP status per line (503 checks).
import { writeFileSync } from 'node:fs';
import net from 'node:net';

const [mode, base, ...rest] = process.argv.slice(2);

function fail(msg) {
  console.error(`load.mjs: ${msg}`);
  process.exit(1);
}

async function post(path, body, signal) {
  return fetch(base + path, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify(body),
    signal,
  });
}

// Reads an SSE response; returns {text, finish, usage, chunks}. onChunk may abort.
async function readStream(res, kind, onChunk) {
  const reader = res.body.getReader();
  const dec = new TextDecoder();
  let buf = '', text = '', finish = null, usage = null, chunks = 0, done = false;
  for (;;) {
    const { value, done: eof } = await reader.read();
    if (eof) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf('\n\n')) >= 0) {
      const ev = buf.slice(0, i);
      buf = buf.slice(i + 2);
      if (!ev.startsWith('data: ')) throw new Error(`bad SSE event: ${ev}`);
      const data = ev.slice(6);
      if (data === '[DONE]') { done = true; continue; }
      const o = JSON.parse(data);
      chunks++;
      if (o.usage) usage = o.usage;
      for (const c of o.choices) {
        text += kind === 'chat' ? (c.delta.content ?? '') : c.text;
        if (c.finish_reason) finish = c.finish_reason;
      }
      if (onChunk && onChunk(o) === 'stop') return { aborted: true };
    }
  }
  if (!done) throw new Error('stream ended without [DONE]');
  return { text, finish, usage, chunks };
}

// ---- greedy -----------------------------------------------------------------------------------
const LONG = 'And God said, Let there be light: and there was light. And God saw the light, that it was good: ' +
  'and God divided the light from the darkness. And God called the light Day, and the darkness he called Night. ';
const GREEDY = [
  { name: 'c1', kind: 'completions', body: { prompt: 'In the beginning God created' } },
  { name: 'c2', kind: 'completions', body: { prompt: 'In the beginning God created the heaven and the earth.' } },
  { name: 'c3', kind: 'completions', body: { prompt: LONG.repeat(6) } },
  { name: 'c4', kind: 'completions', body: { prompt: LONG.repeat(6) + 'And the evening' } },
  { name: 'c5', kind: 'completions', body: { prompt: [4092, 560, 262, 1000, 300] } },
  { name: 's1', kind: 'completions', stream: true, body: { prompt: 'Jesus wept. And' } },
  { name: 'h1', kind: 'chat', body: { messages: [{ role: 'user', content: 'Blessed are the meek' }] } },
  { name: 'h2', kind: 'chat', stream: true, body: { messages: [{ role: 'system', content: 'KJV' }, { role: 'user', content: LONG }] } },
];

async function runOne(r) {
  const body = { ...r.body, max_tokens: 40, temperature: 0, ignore_eos: true, stream: !!r.stream };
  const res = await post(`/v1/${r.kind === 'chat' ? 'chat/completions' : 'completions'}`, body);
  if (res.status !== 200) fail(`${r.name}: HTTP ${res.status}: ${await res.text()}`);
  const kind = r.kind === 'chat' ? 'chat' : 'text';
  if (r.stream) {
    const s = await readStream(res, kind);
    if (s.finish !== 'length') fail(`${r.name}: finish ${s.finish}`);
    return s.text;
  }
  const o = await res.json();
  const c = o.choices[0];
  if (c.finish_reason !== 'length' || o.usage.completion_tokens !== 40) fail(`${r.name}: ${JSON.stringify(o)}`);
  return kind === 'chat' ? c.message.content : c.text;
}

async function filler(i) {
  const body = { prompt: 'And it came to pass ' + 'the '.repeat(i % 13), max_tokens: 8 + (i % 40), temperature: 1, seed: i };
  const res = await post('/v1/completions', body);
  if (res.status !== 200) fail(`filler ${i}: HTTP ${res.status}`);
  await res.json();
}

async function greedy(out, how) {
  const results = {};
  if (how === 'crowd') {
    const jobs = GREEDY.map(async (r) => { results[r.name] = await runOne(r); });
    for (let i = 0; i < 24; i++) jobs.push(filler(i));
    await Promise.all(jobs);
  } else {
    for (const r of GREEDY) results[r.name] = await runOne(r);
  }
  const sorted = Object.fromEntries(Object.keys(results).sort().map((k) => [k, results[k]]));
  writeFileSync(out, JSON.stringify(sorted, null, 1) + '\n');
}

// ---- soak -------------------------------------------------------------------------------------
let seq = 0;
const stats = { ok: 0, aborted: 0, bad: 0 };

async function soakOne(i) {
  const chat = i % 2 === 0, stream = i % 3 !== 0;
  const maxTokens = 1 + ((i * 37) % 32);
  const body = chat
    ? { messages: [{ role: 'user', content: `Psalm ${i % 150}` }], max_tokens: maxTokens, stream, temperature: 0.8, seed: i }
    : { prompt: `Chapter ${i % 50} verse`, max_tokens: maxTokens, stream, temperature: 0.8, seed: i };
  if (stream) body.stream_options = { include_usage: true };
  if (i % 11 === 0) body.stop = ['\n'];
  const ctl = new AbortController();
  const disconnect = stream && i % 7 === 1;
  const res = await post(chat ? '/v1/chat/completions' : '/v1/completions', body, ctl.signal);
  if (res.status !== 200) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
  if (stream) {
    let seen = 0;
    const s = await readStream(res, chat ? 'chat' : 'text', () => {
      if (disconnect && ++seen >= 2) { ctl.abort(); return 'stop'; }
    }).catch((e) => { if (disconnect && e.name === 'AbortError') return { aborted: true }; throw e; });
    if (s.aborted) { stats.aborted++; return; }
    if (!['stop', 'length'].includes(s.finish)) throw new Error(`finish ${s.finish}`);
    if (!s.usage || s.usage.completion_tokens > maxTokens || s.usage.total_tokens !== s.usage.prompt_tokens + s.usage.completion_tokens)
      throw new Error(`usage ${JSON.stringify(s.usage)}`);
    if (s.finish === 'length' && s.usage.completion_tokens !== maxTokens) throw new Error('length before max_tokens');
  } else {
    const o = await res.json();
    const c = o.choices[0];
    if (!['stop', 'length'].includes(c.finish_reason)) throw new Error(`finish ${c.finish_reason}`);
    if (o.usage.completion_tokens > maxTokens) throw new Error('too many tokens');
    if (o.object !== (chat ? 'chat.completion' : 'text_completion')) throw new Error(`object ${o.object}`);
  }
  stats.ok++;
}

async function soak(n, conc) {
  const worker = async () => {
    for (;;) {
      const i = seq++;
      if (i >= n) return;
      try { await soakOne(i); } catch (e) { stats.bad++; console.error(`request ${i}: ${e.message}`); }
    }
  };
  await Promise.all(Array.from({ length: conc }, worker));
  console.log(`soak: ${stats.ok} ok, ${stats.aborted} disconnected mid-stream, ${stats.bad} bad`);
  if (stats.bad || stats.ok + stats.aborted !== n || stats.aborted === 0) process.exit(1);
}

// ---- burst ------------------------------------------------------------------------------------
async function burst(n, body) {
  const codes = await Promise.all(Array.from({ length: n }, async () => {
    const res = await post('/v1/completions', JSON.parse(body));
    const t = await res.text();
    return `${res.status} ${res.headers.get('retry-after') ?? '-'} ${t.slice(0, 200).replace(/\n/g, ' ')}`;
  }));
  console.log(codes.join('\n'));
}

// ---- idle -------------------------------------------------------------------------------------
async function idle(n) {
  const u = new URL(base);
  const socks = await Promise.all(Array.from({ length: n }, (_, i) => new Promise((resolve, reject) => {
    const s = net.connect(Number(u.port), u.hostname, () => {
      if (i % 2) s.write('POST /v1/completions HTTP/1.1\r\nHost: x\r\n');  // never finished
      resolve(s);
    });
    s.on('error', reject);
  })));
  const ctls = [], streams = [];
  for (let i = 0; i < 16; i++) {
    const ctl = new AbortController();
    ctls.push(ctl);
    const res = await post('/v1/completions', { prompt: 'And', max_tokens: 1500, ignore_eos: true, stream: true }, ctl.signal);
    if (res.status !== 200) fail(`stream ${i}: HTTP ${res.status}`);
    streams.push(res.body.getReader().read());  // first bytes arrive; then it stays open
  }
  await Promise.all(streams);
  const t0 = Date.now();
  const res = await post('/v1/completions', { prompt: 'In the beginning', max_tokens: 4 });
  const o = await res.json();
  if (res.status !== 200 || o.usage.completion_tokens !== 4) fail(`with ${n} idle connections: ${JSON.stringify(o)}`);
  console.log(`idle: ${n} idle connections + 16 open streams, a 4-token completion took ${Date.now() - t0} ms`);
  for (const c of ctls) c.abort();
  for (const s of socks) s.destroy();
}

try {
  if (mode === 'idle') await idle(Number(rest[0]));
  else if (mode === 'greedy') await greedy(rest[0], rest[1] || 'alone');
  else if (mode === 'soak') await soak(Number(rest[0]), Number(rest[1]));
  else if (mode === 'burst') await burst(Number(rest[0]), rest[1]);
  else fail(`unknown mode ${mode}`);
} catch (e) {
  fail(e.stack || String(e));
}
