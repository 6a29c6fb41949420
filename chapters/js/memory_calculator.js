/* The memory calculator of chapter 13 (chapters/13_calculator.md).
 *
 * The formulas mirror minifsdp/measure/analytic.py line for line, under the same names in camelCase:
 *   modelStateBytes = model_state_bytes     commBytesPerStep = comm_bytes_per_step
 *   layerParams     = layer_params          paramCount       = param_count
 *   activationBytes = activation_bytes      estimate         = estimate   (the function this file exists for)
 * A shape is a plain object with the fields of analytic.ModelShape, and estimate() takes the keyword
 * arguments of analytic.estimate as one object with the same names. tests/test_ch13_calculator.py runs
 * both over a grid of inputs and checks they agree.
 *
 * Below the formulas, the form the page's <div id="memory-calculator"> receives, and a compact widget for a
 * chapter (<div class="mc-compact">: a few inputs and the bars; see mountCompact). Plain JavaScript, no
 * build step: the browser runs this file as a script, and node can require() the formulas.
 */
(function () {
  "use strict";

  // ---- the formulas (analytic.py) -------------------------------------------------------------------

  const FP32_ADAM = [4, 4, 8]; // bytes per parameter of (params, grads, optimizer state)

  function mixedPrecisionAdam(k = 12) {
    return [2, 2, k];
  }

  function modelStateBytes(psi, worldSize, stage, bytesPerParam = FP32_ADAM) {
    if (![0, 1, 2, 3].includes(stage)) throw new Error(`stage must be 0 (DDP), 1, 2 or 3, not ${stage}`);
    const [p, g, o] = bytesPerParam.map((b) => b * psi);
    const n = worldSize;
    const sharded = { 0: [], 1: ["optim"], 2: ["grads", "optim"], 3: ["params", "grads", "optim"] }[stage];
    const full = { params: p, grads: g, optim: o };
    const out = {};
    for (const [k, v] of Object.entries(full)) out[k] = sharded.includes(k) ? v / n : v;
    out.total = out.params + out.grads + out.optim;
    return out;
  }

  function commBytesPerStep(psi, worldSize, stage, dtypeBytes = 4) {
    const n = worldSize;
    const passes = stage === 3 ? 3 : 2;
    return (passes * psi * dtypeBytes * (n - 1)) / n;
  }

  const PRESETS = { // Llama 3.2 1B and Llama 2 7B / 13B / 70B
    "1B": { layers: 16, hidden: 2048, heads: 32, vocab: 128256, ffn: 8192, kv_heads: 8, gated: true, tied: true },
    "7B": { layers: 32, hidden: 4096, heads: 32, vocab: 32000, ffn: 11008, kv_heads: 32, gated: true, tied: false },
    "13B": { layers: 40, hidden: 5120, heads: 40, vocab: 32000, ffn: 13824, kv_heads: 40, gated: true, tied: false },
    "70B": { layers: 80, hidden: 8192, heads: 64, vocab: 32000, ffn: 28672, kv_heads: 8, gated: true, tied: false },
  };

  function gptShape(layers, hidden, heads, vocab) {
    return { layers, hidden, heads, vocab, ffn: 4 * hidden, kv_heads: heads, gated: false, tied: true };
  }

  function layerParams(shape) {
    const h = shape.hidden, f = shape.ffn;
    const hKv = Math.floor((h * shape.kv_heads) / shape.heads);
    return 2 * h * h + 2 * h * hKv + (shape.gated ? 3 : 2) * h * f;
  }

  function paramCount(shape) {
    return shape.layers * layerParams(shape) + (shape.tied ? 1 : 2) * shape.vocab * shape.hidden;
  }

  function activationBytes(shape, seq, microBatch, checkpointing = "none", dtypeBytes = 2) {
    const s = seq, b = microBatch, h = shape.hidden, a = shape.heads;
    const scale = dtypeBytes / 2;
    const block = s * b * h * (34 + (5 * a * s) / h) * scale;
    let blocks;
    if (checkpointing === "none") {
      blocks = shape.layers * block;
    } else if (checkpointing === "selective") {
      blocks = shape.layers * s * b * h * 34 * scale;
    } else if (checkpointing === "full") {
      blocks = shape.layers * s * b * h * 2 * scale + block;
    } else {
      throw new Error(`checkpointing must be 'none', 'selective' or 'full', not '${checkpointing}'`);
    }
    return blocks + 4 * s * b * shape.vocab;
  }

  const STRATEGIES = { ddp: 0, zero1: 1, zero2: 2, zero3: 3, fsdp: 3, hsdp: 3 }; // the ZeRO stage of each

  function estimate({ shape = null, psi = null, seq = 2048, micro_batch = 1, world_size = 8, strategy = "fsdp",
                      shard_size = null, precision = "bf16", checkpointing = "none", prefetch = true } = {}) {
    if (!(strategy in STRATEGIES)) throw new Error(`strategy must be one of ${Object.keys(STRATEGIES)}, not '${strategy}'`);
    if (!["fp32", "bf16"].includes(precision)) throw new Error(`precision must be 'fp32' or 'bf16', not '${precision}'`);
    const n = world_size, stage = STRATEGIES[strategy];
    const group = strategy === "hsdp" ? (shard_size || n) : n; // the ranks the model states are sharded over
    if (n % group) throw new Error(`the shard group (${group}) must divide the world size (${n})`);
    psi = psi !== null && psi !== undefined ? psi : paramCount(shape);
    const perParam = precision === "fp32" ? FP32_ADAM : mixedPrecisionAdam(12);
    const dtype = perParam[0]; // what is computed with, gathered and reduced: 4 or 2 bytes
    const out = modelStateBytes(psi, group, stage, perParam);
    const unitAlive = stage === 3 && group > 1 && !!shape;
    out.units = unitAlive ? (prefetch ? 2 : 1) * layerParams(shape) * dtype : 0;
    out.activations = shape ? activationBytes(shape, seq, micro_batch, checkpointing, dtype) : 0;
    out.total += out.units + out.activations;
    out.psi = psi;
    if (strategy === "hsdp") { // FSDP inside the group, then an all-reduce of each shard across the groups
      out.sent_within = commBytesPerStep(psi, group, 3, dtype);
      out.sent_across = commBytesPerStep(psi / group, Math.floor(n / group), 0, dtype);
    } else {
      [out.sent_within, out.sent_across] = [commBytesPerStep(psi, n, stage, dtype), 0];
    }
    out.sent = out.sent_within + out.sent_across;
    return out;
  }

  const formulas = { FP32_ADAM, PRESETS, STRATEGIES, mixedPrecisionAdam, modelStateBytes, commBytesPerStep,
                     gptShape, layerParams, paramCount, activationBytes, estimate };
  if (typeof module !== "undefined" && module.exports) module.exports = formulas;
  if (typeof document === "undefined") return; // under node: the formulas only

  // ---- the form -------------------------------------------------------------------------------------

  const CATEGORIES = [ // [key in estimate(), label, the chapter that measures it]
    ["params", "parameters", "2, 5"],
    ["grads", "gradients", "2, 4"],
    ["optim", "optimizer state", "2, 3"],
    ["units", "unsharded FSDP units", "6, 7"],
    ["activations", "activations (estimate)", "2, 9"],
  ];
  const BARS = [["ddp", "DDP"], ["zero1", "ZeRO-1"], ["zero2", "ZeRO-2"], ["fsdp", "ZeRO-3 / FSDP"], ["hsdp", "HSDP"]];
  const SHAPE_FIELDS = [["layers", "layers L"], ["hidden", "hidden h"], ["heads", "heads a"],
                        ["kv_heads", "K/V heads"], ["ffn", "MLP width f"], ["vocab", "vocabulary V"]];

  const gb = (x) => (x / 1e9).toFixed(2);
  const gib = (x) => (x / 2 ** 30).toFixed(2);

  function el(tag, attrs = {}, children = []) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "text") node.textContent = v;
      else if (k === "style") node.style.cssText = v;
      else node.setAttribute(k, v);
    }
    for (const child of [].concat(children)) node.append(child);
    return node;
  }

  function field(label, input, hint) {
    return el("label", { class: "mc-field" }, [el("span", { text: label }), input].concat(hint ? [hint] : []));
  }

  function numberInput(name, value, min = 1) {
    return el("input", { type: "number", name, value: String(value), min: String(min), step: "1" });
  }

  function select(name, options, value) {
    const node = el("select", { name }, options.map(([v, text]) => el("option", { value: v, text })));
    node.value = value;
    return node;
  }

  // Stacked bars, one per strategy (results: [key, label, estimate()]), the current one in bold; `categories`
  // are the segments stacked (of CATEGORIES), and a bar's total is their sum; `capacity` > 0 draws the device's
  // memory as a dashed line, and marks a total over it with ✗.
  function bars(results, current, capacity, categories = CATEGORIES) {
    const total = (r) => categories.reduce((sum, [k]) => sum + r[k], 0);
    const scale = Math.max(capacity, ...results.map(([, , r]) => total(r))) || 1;
    const pct = (x) => `${(100 * x) / scale}%`;
    const lines = results.map(([key, label, r]) => el("div", { class: "mc-bar-row" + (key === current ? " mc-current" : "") }, [
      el("span", { class: "mc-bar-label", text: label }),
      el("span", { class: "mc-bar" }, categories.map(([k, name]) =>
        el("span", { class: `mc-seg mc-${k}`, style: `width:${pct(r[k])}`, title: `${name}: ${gb(r[k])} GB` }))
        .concat(capacity > 0 ? [el("span", { class: "mc-capacity", style: `left:${pct(capacity)}`, title: `${gb(capacity)} GB` })] : [])),
      el("span", { class: "mc-bar-value", text: `${gb(total(r))} GB` + (capacity > 0 && total(r) > capacity ? " ✗" : "") }),
    ]));
    const legend = el("div", { class: "mc-legend" }, categories.map(([k, name]) =>
      el("span", {}, [el("span", { class: `mc-swatch mc-${k}` }), name])).concat(capacity > 0 ?
      [el("span", {}, [el("span", { class: "mc-swatch mc-capacity-key" }), `device memory, ${gb(capacity)} GB`])] : []));
    return el("div", { class: "mc-bars" }, lines.concat([legend]));
  }

  function mount(root) {
    if (root.dataset.mounted) return;
    root.dataset.mounted = "1";
    root.classList.add("mc");
    root.textContent = "";

    const preset = select("preset", Object.keys(PRESETS).map((k) => [k, k]).concat([["custom", "custom"]]), "7B");
    const shapeInputs = Object.fromEntries(SHAPE_FIELDS.map(([k]) => [k, numberInput(k, PRESETS["7B"][k])]));
    const mlp = select("gated", [["1", "SwiGLU, 3 matrices (Llama)"], ["0", "GELU, 2 matrices (GPT)"]], "1");
    const tied = el("input", { type: "checkbox", name: "tied" });
    const psiInput = el("input", { type: "number", name: "psi", min: "1", step: "1", placeholder: "from the shape" });
    const psiNote = el("span", { class: "mc-note" });
    const seq = numberInput("seq", 4096), microBatch = numberInput("micro_batch", 1), n = numberInput("world_size", 64);
    const strategy = select("strategy", [["ddp", "DDP"], ["zero1", "ZeRO-1 (optimizer state sharded)"],
      ["zero2", "ZeRO-2 (+ gradients)"], ["fsdp", "ZeRO-3 / FSDP (+ parameters)"],
      ["hsdp", "HSDP (FSDP within a group, replicated across)"]], "fsdp");
    const shardSize = numberInput("shard_size", 8);
    const precision = select("precision", [["bf16", "bf16 mixed, fp32 master (2 + 2 + 12 bytes)"],
      ["fp32", "fp32 (4 + 4 + 8 bytes)"]], "bf16");
    const checkpointing = select("checkpointing", [["none", "none"],
      ["selective", "selective: attention recomputed (as FlashAttention)"], ["full", "full, per layer"]], "selective");
    const prefetch = el("input", { type: "checkbox", name: "prefetch", checked: "" });
    const device = numberInput("device_gb", 80);

    const form = el("form", { class: "mc-form" }, [
      el("fieldset", {}, [el("legend", { text: "Model" }), field("preset", preset)]
        .concat(SHAPE_FIELDS.map(([k, label]) => field(label, shapeInputs[k])))
        .concat([field("MLP", mlp), field("output head tied to the embedding", tied), field("Ψ (parameters)", psiInput, psiNote)])),
      el("fieldset", {}, [el("legend", { text: "Training" }), field("sequence length s", seq),
        field("micro-batch b", microBatch), field("ranks N", n), field("strategy", strategy),
        field("HSDP shard group", shardSize), field("precision", precision),
        field("activation checkpointing", checkpointing), field("FSDP prefetch (two units alive)", prefetch),
        field("device memory, GB", device)]),
    ]);
    const output = el("div", { class: "mc-output", "aria-live": "polite" });
    root.append(form, output);

    function shapeFromForm() {
      const shape = Object.fromEntries(SHAPE_FIELDS.map(([k]) => [k, parseInt(shapeInputs[k].value, 10)]));
      shape.gated = mlp.value === "1";
      shape.tied = tied.checked;
      return shape;
    }

    function inputs(strategyName) {
      const psi = psiInput.value.trim() === "" ? null : Number(psiInput.value);
      return { shape: shapeFromForm(), psi, seq: parseInt(seq.value, 10), micro_batch: parseInt(microBatch.value, 10),
               world_size: parseInt(n.value, 10), strategy: strategyName, shard_size: parseInt(shardSize.value, 10),
               precision: precision.value, checkpointing: checkpointing.value, prefetch: prefetch.checked };
    }

    function table(r) {
      const rows = CATEGORIES.map(([k, label, ch]) => el("tr", {}, [
        el("td", {}, [el("span", { class: `mc-swatch mc-${k}` }), label]), el("td", { text: gb(r[k]) }),
        el("td", { text: gib(r[k]) }), el("td", { text: ch })]));
      rows.push(el("tr", { class: "mc-total" }, [el("td", { text: "total per rank" }), el("td", { text: gb(r.total) }),
        el("td", { text: gib(r.total) }), el("td", { text: "" })]));
      const head = el("tr", {}, ["per rank", "GB (10⁹ B)", "GiB (2³⁰ B)", "measured in chapter"].map((t) => el("th", { text: t })));
      return el("table", { class: "mc-table" }, [el("thead", {}, head), el("tbody", {}, rows)]);
    }

    function check() {
      const named = SHAPE_FIELDS.concat([["seq", "sequence length"], ["micro_batch", "micro-batch"], ["world_size", "ranks N"]]);
      const given = Object.assign({}, inputs("ddp").shape, inputs("ddp"));
      for (const [k, label] of named) {
        if (!(Number.isInteger(given[k]) && given[k] > 0)) throw new Error(`${label} must be a positive whole number`);
      }
      if (given.psi !== null && !(given.psi > 0)) throw new Error("Ψ must be positive, or blank");
      if (strategy.value === "hsdp" && !(Number.isInteger(given.shard_size) && given.shard_size > 0)) {
        throw new Error("the HSDP shard group must be a positive whole number");
      }
    }

    function render() {
      output.textContent = "";
      let r;
      try {
        check();
        r = estimate(inputs(strategy.value));
      } catch (err) {
        output.append(el("p", { class: "mc-error", text: err.message }));
        return;
      }
      psiNote.textContent = `Ψ = ${(r.psi / 1e9).toFixed(3)} billion` + (psiInput.value.trim() === "" ? " from the shape" : "");
      const sent = [el("strong", { text: `Sent per rank per step: ${gb(r.sent)} GB` }), ` (${gib(r.sent)} GiB)`];
      if (strategy.value === "hsdp") {
        sent.push(`: ${gb(r.sent_within)} GB within the shard group, ${gb(r.sent_across)} GB across the groups`);
      }
      const results = [];
      for (const [key, label] of BARS) {
        const name = key === "hsdp" ? `HSDP, groups of ${shardSize.value}` : label;
        try { results.push([key, name, estimate(inputs(key))]); } catch (err) { /* HSDP: a group that does not divide N */ }
      }
      output.append(table(r), el("p", {}, sent), bars(results, strategy.value, 1e9 * Number(device.value || 0)));
    }

    function fillPreset() {
      if (preset.value === "custom") return;
      const shape = PRESETS[preset.value];
      for (const [k] of SHAPE_FIELDS) shapeInputs[k].value = String(shape[k]);
      mlp.value = shape.gated ? "1" : "0";
      tied.checked = shape.tied;
    }

    preset.addEventListener("change", () => { fillPreset(); render(); });
    form.addEventListener("input", (event) => {
      if (event.target !== preset && (event.target.name in shapeInputs || event.target === mlp || event.target === tied)) {
        preset.value = "custom";
      }
      shardSize.disabled = strategy.value !== "hsdp";
      render();
    });
    form.addEventListener("submit", (event) => event.preventDefault());
    shardSize.disabled = strategy.value !== "hsdp";
    fillPreset();
    render();
  }

  // ---- the compact widget ---------------------------------------------------------------------------
  // A chapter's few inputs and its bars, for one of two models:
  //   <div class="mc-compact" data-model="psi">     Ψ typed in billions, N ranks: a bar per ZeRO stage, the
  //                                                 model states alone (chapter 2)
  //   <div class="mc-compact" data-model="preset">  a preset's shape and one strategy: a bar per world size
  //                                                 (data-ns), FSDP's unsharded units as well (chapter 6)
  // data-psi, data-preset, data-n, data-ns, data-precision, data-strategy and data-device set the first values.
  // Activations are left out (they need a sequence and a batch): the full calculator adds them.
  const STAGES = [["ddp", "DDP"], ["zero1", "ZeRO-1"], ["zero2", "ZeRO-2"], ["fsdp", "ZeRO-3 / FSDP"]];

  function mountCompact(root) {
    if (root.dataset.mounted) return;
    root.dataset.mounted = "1";
    root.classList.add("mc");
    root.textContent = "";
    const d = root.dataset, byPreset = d.model === "preset";
    const model = byPreset
      ? select("preset", Object.keys(PRESETS).map((k) => [k, k === "1B" ? "Llama 3.2 1B" : `Llama 2 ${k}`]), d.preset || "7B")
      : el("input", { type: "number", name: "psi_billions", value: d.psi || "7.5", min: "0", step: "any" });
    const n = numberInput("world_size", d.n || 64);
    const worldSizes = (d.ns || "8 16 32 64 128 256 512 1024").split(/\s+/).map(Number);
    const precision = select("precision", [["bf16", "bf16 mixed: 2+2+12"], ["fp32", "fp32: 4+4+8"]],
                             d.precision || "bf16");
    const strategy = select("strategy", STAGES, d.strategy || "fsdp");
    const prefetch = el("input", { type: "checkbox", name: "prefetch", checked: "" });
    const device = numberInput("device_gb", d.device || 80);
    const fields = [field(byPreset ? "model" : "parameters Ψ, billions", model)]
      .concat(byPreset ? [] : [field("ranks N", n)])
      .concat([field("precision, bytes", precision), field("strategy", strategy)])
      .concat(byPreset ? [field("prefetch (2 units)", prefetch)] : [])
      .concat([field("device memory, GB", device)]);
    const form = el("form", { class: "mc-form mc-compact-form" }, fields);
    const output = el("div", { class: "mc-output", "aria-live": "polite" });
    root.append(form, output);
    const categories = CATEGORIES.filter(([k]) => k !== "activations" && (byPreset || k !== "units"));
    const kept = (r) => categories.reduce((sum, [k]) => sum + r[k], 0);

    function inputs(name, worldSize) {
      return { shape: byPreset ? PRESETS[model.value] : null, psi: byPreset ? null : Number(model.value) * 1e9,
               world_size: worldSize, strategy: name, precision: precision.value, prefetch: prefetch.checked };
    }

    function readout(label, r, tail) {
      return el("p", { class: "mc-readout" }, [el("strong", { text: `${label}: ${gb(kept(r))} GB per rank` }), tail]);
    }

    function render() {
      output.textContent = "";
      const capacity = 1e9 * Number(device.value || 0);
      try {
        if (byPreset) { // one strategy, a bar per world size
          const label = STAGES.find(([key]) => key === strategy.value)[1];
          const rows = worldSizes.map((w) => [`N = ${w}`, `N = ${w}`, estimate(inputs(strategy.value, w))]);
          const [last, , r] = rows[rows.length - 1];
          const units = r.units > 0 ? `, of which ${gb(r.units)} GB are the unsharded units, which no N shrinks` : "";
          output.append(bars(rows, last, capacity, categories), readout(`${label} at ${last}`, r, `${units}.`));
        } else { // one world size, a bar per ZeRO stage
          const w = parseInt(n.value, 10);
          if (!(Number.isInteger(w) && w > 0)) throw new Error("ranks N must be a positive whole number");
          if (!(Number(model.value) > 0)) throw new Error("Ψ must be positive");
          const rows = STAGES.map(([key, label]) => [key, label, estimate(inputs(key, w))]);
          const [, label, r] = rows.find(([key]) => key === strategy.value);
          const ddp = rows[0][2];
          const ratio = ddp.sent > 0 ? ` (${(r.sent / ddp.sent).toFixed(2)} × DDP's)` : "";
          output.append(bars(rows, strategy.value, capacity, categories),
                        readout(label, r, `, ${gb(r.sent)} GB sent per rank per step${ratio}.`));
        }
      } catch (err) {
        output.textContent = "";
        output.append(el("p", { class: "mc-error", text: err.message }));
      }
    }

    form.addEventListener("input", render);
    form.addEventListener("submit", (event) => event.preventDefault());
    render();
  }

  function mountAll() {
    const root = document.querySelector("div#memory-calculator"); // the div: a heading's anchor may share the id
    if (root) mount(root);
    for (const compact of document.querySelectorAll("div.mc-compact")) mountCompact(compact);
  }

  // mkdocs-material's instant navigation, when enabled, announces each new page on document$
  if (typeof window.document$ !== "undefined" && window.document$.subscribe) window.document$.subscribe(mountAll);
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", mountAll);
  else mountAll();
})();
