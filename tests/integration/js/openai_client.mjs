// openai_client.mjs — pdserve through the official `openai` npm client: completions and chat,
// streaming and not, usage (with include_usage), n > 1, stop strings, logprobs, and the client's
// error classes for a 400 and a 404. Usage: node openai_client.mjs BASE_URL MODEL
import OpenAI from 'openai';
import assert from 'node:assert/strict';

const [base, model] = process.argv.slice(2);
// fetch: Node's own (undici). The SDK's default on Node is node-fetch 2.7, whose "bad chunked
// ending" detector raises a false "Premature close" when a keep-alive socket is reused
// (node-fetch#1767): on Debian 12's Node 18 every stream after the first request failed that way,
// while the same exchange passes with undici, and with node-fetch once keep-alive is off.
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60000, fetch: globalThis.fetch });
let n = 0;
const check = (name, fn) => fn().then(() => { n++; console.log(`ok   ${name}`); });

await check('models.list', async () => {
  const page = await client.models.list();
  assert.equal(page.data[0].id, model);
});

await check('completions.create', async () => {
  const r = await client.completions.create({ model, prompt: 'In the beginning God', max_tokens: 12, temperature: 0 });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.ok(r.choices[0].text.length > 0);
  assert.equal(r.usage.completion_tokens, 12);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 12);
});

await check('completions.create stream == non-stream', async () => {
  const args = { model, prompt: 'And God said', max_tokens: 16, temperature: 0 };
  const whole = (await client.completions.create(args)).choices[0].text;
  let text = '', finish = null;
  for await (const chunk of await client.completions.create({ ...args, stream: true })) {
    assert.equal(chunk.object, 'text_completion');
    text += chunk.choices[0]?.text ?? '';
    finish = chunk.choices[0]?.finish_reason ?? finish;
  }
  assert.equal(text, whole);
  assert.equal(finish, 'length');
});

await check('chat.completions.create', async () => {
  const r = await client.chat.completions.create({
    model, messages: [{ role: 'system', content: 'KJV' }, { role: 'user', content: 'Blessed are' }], max_tokens: 10, temperature: 0,
  });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(typeof r.choices[0].message.content, 'string');
  assert.ok(['stop', 'length'].includes(r.choices[0].finish_reason));
  assert.ok(r.usage.prompt_tokens > 0);
});

await check('chat.completions.create stream + include_usage', async () => {
  const args = { model, messages: [{ role: 'user', content: 'Jesus wept' }], max_tokens: 12, temperature: 0 };
  const whole = (await client.chat.completions.create(args)).choices[0].message.content;
  let text = '', role = null, usage = null, first = true;
  const stream = await client.chat.completions.create({ ...args, stream: true, stream_options: { include_usage: true } });
  for await (const chunk of stream) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    if (chunk.usage) usage = chunk.usage;
    const c = chunk.choices[0];
    if (!c) continue;
    if (first) { role = c.delta.role; first = false; }
    text += c.delta.content ?? '';
  }
  assert.equal(role, 'assistant');
  assert.equal(text, whole);
  assert.ok(usage && usage.completion_tokens > 0 && usage.total_tokens === usage.prompt_tokens + usage.completion_tokens);
});

await check('chat stream helper (finalChatCompletion)', async () => {
  const runner = client.beta.chat.completions.stream({ model, messages: [{ role: 'user', content: 'And' }], max_tokens: 6, temperature: 0 });
  const final = await runner.finalChatCompletion();
  assert.equal(final.choices[0].message.role, 'assistant');
});

await check('n=2, seed, stop, logprobs', async () => {
  const r = await client.completions.create({ model, prompt: 'And', max_tokens: 8, n: 2, seed: 3, temperature: 1, logprobs: 2 });
  assert.deepEqual(r.choices.map((c) => c.index).sort(), [0, 1]);
  assert.ok(r.choices[0].logprobs.tokens.length > 0);
  const s = await client.completions.create({ model, prompt: 'In the beginning God created the heaven', max_tokens: 40, temperature: 0, stop: [' and'] });
  assert.ok(!s.choices[0].text.includes(' and'));
  const c = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'And' }], max_tokens: 3, logprobs: true, top_logprobs: 2 });
  assert.equal(c.choices[0].logprobs.content[0].top_logprobs.length, 2);
});

await check('errors: BadRequestError and NotFoundError', async () => {
  await assert.rejects(client.completions.create({ model, prompt: 'x', max_tokens: 0 }), (e) => {
    assert.ok(e instanceof OpenAI.BadRequestError);
    assert.equal(e.status, 400);
    assert.equal(e.param, 'max_tokens');
    assert.equal(e.type, 'invalid_request_error');
    return true;
  });
  await assert.rejects(client.chat.completions.create({ model: 'gpt-4o', messages: [{ role: 'user', content: 'x' }] }), (e) => {
    assert.ok(e instanceof OpenAI.NotFoundError);
    assert.equal(e.code, 'model_not_found');
    return true;
  });
});

console.log(`openai client: ${n} checks passed`);
