// bench/llama3_vocab.mjs TEMPLATE_TOKENIZER_JSON OUT — used by bench/mask_cost.sh.
// Writes a Hugging Face tokenizer.json with Llama 3's real vocabulary (128,000 BPE tokens + 256
// special) from the npm package llama3-tokenizer-js, on the pipeline of the kjv tokenizer.json
// (which spells Meta-Llama-3's pipeline).
import fs from 'fs';
import llama3Tokenizer from 'llama3-tokenizer-js';
const [tmpl, out] = process.argv.slice(2);
const t = llama3Tokenizer, j = JSON.parse(fs.readFileSync(tmpl, 'utf8'));
const vocab = {};
for (let i = 0; i < 128000; i++) vocab[t.vocabById[i]] = i;
const merges = [...t.merges.entries()].sort((a, b) => a[1] - b[1]).map(([k]) => { const s = k.indexOf(' ', 1); return [k.slice(0, s), k.slice(s + 1)]; });
j.model.vocab = vocab; j.model.merges = merges;
j.added_tokens = [];
for (let i = 128000; i < 128256; i++) j.added_tokens.push({id: i, content: t.vocabById[i], single_word: false, lstrip: false, rstrip: false, normalized: false, special: true});
const fix = (o) => { if (o && typeof o === 'object') { for (const k of Object.keys(o)) { if (k === 'special_tokens' && o[k]['<|begin_of_text|>']) o[k]['<|begin_of_text|>'].ids = [128000]; else fix(o[k]); } } };
fix(j.post_processor);
fs.writeFileSync(out, JSON.stringify(j));
console.log('vocab', Object.keys(vocab).length, 'merges', merges.length, 'added', j.added_tokens.length);
