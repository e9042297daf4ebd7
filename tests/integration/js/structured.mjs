// structured.mjs — structured outputs and tool calls through clients nobody here wrote: the
// `openai` client (response_format json_schema, tools, logit_bias), the Vercel AI SDK
// (generateObject / streamObject with a zod schema, through @ai-sdk/openai-compatible) and
// LangChain JS (withStructuredOutput, bindTools). The bundled 6M-parameter model writes odd
// content; constrained decoding must still make every object parse and validate, and every
// forced tool call arrive as tool_calls. Usage: node structured.mjs BASE_URL MODEL
import OpenAI from 'openai';
import assert from 'node:assert/strict';
import { z } from 'zod';
import { generateObject, streamObject } from 'ai';
import { createOpenAICompatible } from '@ai-sdk/openai-compatible';
import { ChatOpenAI } from '@langchain/openai';
import { tool } from '@langchain/core/tools';
import { webcrypto } from 'node:crypto';
// Node 18 (Debian 12) has no global Web Crypto; LangChain's langsmith calls crypto.getRandomValues.
if (!globalThis.crypto) globalThis.crypto = webcrypto;

const [base, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 120000, fetch: globalThis.fetch });  // Node's fetch: see openai_client.mjs (node-fetch + Node 18)
let n = 0;
const check = (name, fn) => fn().then(() => { n++; console.log(`ok   ${name}`); });

// A schema small enough for a tiny model to finish: bounded strings and arrays.
const Person = z.object({
  name: z.string().max(16),
  age: z.number().int().min(0).max(150),
  kind: z.enum(['prophet', 'king', 'priest']),
  books: z.array(z.string().max(12)).max(2),
  alive: z.boolean(),
});
const personSchema = z.toJSONSchema(Person);

const Weather = z.object({ city: z.string().max(12), days: z.number().int().min(1).max(7) });
const weatherTool = {
  type: 'function',
  function: { name: 'get_weather', description: 'Weather forecast for a city', parameters: z.toJSONSchema(Weather) },
};

await check('openai: response_format json_schema parses and validates', async () => {
  for (const seed of [1, 2, 3]) {
    const r = await client.chat.completions.create({
      model, seed, temperature: 0.8, max_tokens: 300,
      messages: [{ role: 'user', content: 'Describe a person of the Bible as JSON.' }],
      response_format: { type: 'json_schema', json_schema: { name: 'person', strict: true, schema: personSchema } },
    });
    assert.equal(r.choices[0].finish_reason, 'stop', r.choices[0].message.content);
    Person.parse(JSON.parse(r.choices[0].message.content));
  }
});

await check('openai: response_format json_schema, streamed', async () => {
  let text = '', finish = null;
  const stream = await client.chat.completions.create({
    model, seed: 9, max_tokens: 300, stream: true,
    messages: [{ role: 'user', content: 'A king, as JSON.' }],
    response_format: { type: 'json_schema', json_schema: { name: 'person', schema: personSchema } },
  });
  for await (const c of stream) {
    text += c.choices[0]?.delta?.content ?? '';
    finish = c.choices[0]?.finish_reason ?? finish;
  }
  assert.equal(finish, 'stop');
  Person.parse(JSON.parse(text));
});

await check('openai: tools with tool_choice required -> tool_calls', async () => {
  const r = await client.chat.completions.create({
    model, seed: 4, max_tokens: 200, parallel_tool_calls: false,
    messages: [{ role: 'user', content: 'What is the weather in Jerusalem?' }],
    tools: [weatherTool], tool_choice: 'required',
  });
  const m = r.choices[0].message;
  assert.equal(r.choices[0].finish_reason, 'tool_calls');
  assert.equal(m.tool_calls.length, 1);
  assert.equal(m.tool_calls[0].type, 'function');
  assert.equal(m.tool_calls[0].function.name, 'get_weather');
  assert.match(m.tool_calls[0].id, /^call_/);
  Weather.parse(JSON.parse(m.tool_calls[0].function.arguments));
  // The conversation goes on with the tool's answer.
  const r2 = await client.chat.completions.create({
    model, max_tokens: 8, temperature: 0,
    messages: [{ role: 'user', content: 'What is the weather in Jerusalem?' }, m,
               { role: 'tool', tool_call_id: m.tool_calls[0].id, content: '{"sky":"clear"}' }],
    tools: [weatherTool],
  });
  assert.equal(typeof r2.choices[0].message.content, 'string');
});

await check('openai: named tool_choice, streamed tool_calls deltas', async () => {
  const stream = await client.chat.completions.create({
    model, seed: 5, max_tokens: 200, stream: true,
    messages: [{ role: 'user', content: 'Weather in Bethlehem for three days?' }],
    tools: [weatherTool, { type: 'function', function: { name: 'noop', parameters: { type: 'object', properties: {} } } }],
    tool_choice: { type: 'function', function: { name: 'get_weather' } },
  });
  const calls = [];
  let finish = null;
  for await (const c of stream) {
    for (const d of c.choices[0]?.delta?.tool_calls ?? []) {
      calls[d.index] ??= { id: '', name: '', args: '' };
      calls[d.index].id += d.id ?? '';
      calls[d.index].name += d.function?.name ?? '';
      calls[d.index].args += d.function?.arguments ?? '';
    }
    finish = c.choices[0]?.finish_reason ?? finish;
  }
  assert.equal(finish, 'tool_calls');
  assert.equal(calls.length, 1);
  assert.equal(calls[0].name, 'get_weather');
  Weather.parse(JSON.parse(calls[0].args));
});

await check('openai: logit_bias -100 bans a token', async () => {
  // The greedy first token of this prompt, then the same request with that token banned.
  const args = { model, prompt: 'And God said, Let there be', max_tokens: 24, temperature: 0, return_token_ids: true };
  const r = await client.completions.create(args);
  const ids = r.choices[0].token_ids;
  assert.ok(Array.isArray(ids) && ids.length > 0);
  const banned = ids[0];
  const counts = new Map();
  for (const t of ids) counts.set(t, (counts.get(t) ?? 0) + 1);
  const often = [...counts.entries()].sort((a, b) => b[1] - a[1])[0][0];  // the most repeated one too
  const bias = { [banned]: -100, [often]: -100 };
  for (const temperature of [0, 1.2]) {
    const b = await client.completions.create({ ...args, temperature, seed: 3, n: 3, max_tokens: 48, logit_bias: bias });
    for (const c of b.choices) {
      assert.ok(!c.token_ids.includes(banned) && !c.token_ids.includes(often), `banned token drawn: ${c.token_ids}`);
    }
  }
});

const provider = createOpenAICompatible({ name: 'pdserve', baseURL: `${base}/v1`, apiKey: 'unused',
                                          supportsStructuredOutputs: true });

await check('AI SDK: generateObject with a zod schema', async () => {
  const { object, finishReason } = await generateObject({
    model: provider(model), schema: Person, prompt: 'Name a prophet.', maxOutputTokens: 300, seed: 11,
    maxRetries: 0,
  });
  assert.equal(finishReason, 'stop');
  Person.parse(object);
});

await check('AI SDK: streamObject with a zod schema', async () => {
  const result = streamObject({
    model: provider(model), schema: Person, prompt: 'Name a king.', maxOutputTokens: 300, seed: 12, maxRetries: 0,
  });
  let partials = 0;
  for await (const p of result.partialObjectStream) { partials++; assert.equal(typeof p, 'object'); }
  const object = await result.object;
  Person.parse(object);
  assert.ok(partials > 0);
});

const llm = new ChatOpenAI({ model, apiKey: 'unused', configuration: { baseURL: `${base}/v1`, fetch: globalThis.fetch }, maxTokens: 300,
                             temperature: 0.7, maxRetries: 0 });

await check('LangChain: withStructuredOutput (json schema and function calling)', async () => {
  for (const method of ['jsonSchema', 'functionCalling']) {
    const out = await llm.withStructuredOutput(Person, { name: 'person', method }).invoke('Describe a priest.');
    Person.parse(out);
  }
});

await check('LangChain: bindTools returns tool_calls', async () => {
  const weather = tool(async ({ city }) => `sunny in ${city}`, {
    name: 'get_weather', description: 'Weather forecast for a city', schema: Weather,
  });
  const msg = await llm.bindTools([weather], { tool_choice: 'get_weather' }).invoke('Weather in Nazareth?');
  assert.equal(msg.tool_calls.length, 1);
  assert.equal(msg.tool_calls[0].name, 'get_weather');
  Weather.parse(msg.tool_calls[0].args);
  const any = await llm.bindTools([weather], { tool_choice: 'any', parallel_tool_calls: false }).invoke('Weather?');
  assert.ok(any.tool_calls.length >= 1);
  for (const c of any.tool_calls) Weather.parse(c.args);
});

console.log(`structured.mjs: ${n} checks passed`);
