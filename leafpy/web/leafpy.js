// leafpy.js: run a network exported by `leafpy export --web` (or lp.web.export) in the browser, on WebGPU, with
// the same WGSL kernels and the same dispatches as leafpy's webgpu backend. No build step, no dependencies.
//
//   const {load} = await import("./leafpy.js");
//   const m = await load("./model/");
//   const y = await m.predict(x /* Float32Array */, [n, ...m.inputShape]);   // {data: Float32Array, shape}
//   m.classes   // class names ([] if the run had none)
//   m.inUnits(y) // a regression's output in its targets' units (as `leafpy predict` gives it)
//   m.precision // "fp16" where the export has float16 plans and the adapter offers shader-f16, else "fp32"
//
// model/plan.json lists, per batch size, the forward pass as steps (a dispatch: shader module, entry point,
// pipeline constants, uniform bytes, workgroup grid, bound buffers; or a write of a constant). predict() runs a
// batch of any size over those plans: the largest plan while the rest fills it, then the smallest plan that holds
// what is left, padded with zeros.

const FORMAT = "leafpy-web";

function fail(message) {
  return new Error(`leafpy.js: ${message}`);
}

async function fetchBytes(url, what) {
  let response;
  try {
    response = await fetch(url);
  } catch (e) {
    throw fail(`cannot fetch the model file ${url} (${e.message}); serve the exported folder over http(s)`);
  }
  if (!response.ok) {
    throw fail(`the model file ${url} (${what}) is missing (HTTP ${response.status}); copy the whole folder ` +
               "that leafpy export --web wrote, or export the model again");
  }
  return response.arrayBuffer();
}

function hex(buffer) {
  return Array.from(new Uint8Array(buffer), (b) => b.toString(16).padStart(2, "0")).join("");
}

async function checkedBytes(base, entry, what) {
  const url = new URL(entry.file, base).href;
  const bytes = await fetchBytes(url, what);
  if (bytes.byteLength !== entry.bytes) {
    throw fail(`the model file ${url} (${what}) is damaged: ${bytes.byteLength} bytes where plan.json expects ` +
               `${entry.bytes}; export the model again`);
  }
  if (!globalThis.crypto || !crypto.subtle) {
    throw fail("checking the model files needs crypto.subtle (a secure context: https or localhost)");
  }
  const digest = hex(await crypto.subtle.digest("SHA-256", bytes));
  if (digest !== entry.sha256) {
    throw fail(`the model file ${url} (${what}) is damaged: its SHA-256 is ${digest}, plan.json expects ` +
               `${entry.sha256}; export the model again`);
  }
  return bytes;
}

async function readPlan(base) {
  const url = new URL("plan.json", base).href;
  const bytes = await fetchBytes(url, "the network's plan");
  let doc;
  try {
    doc = JSON.parse(new TextDecoder().decode(bytes));
  } catch (e) {
    throw fail(`the model file ${url} is damaged: not JSON (${e.message}); export the model again`);
  }
  const plans = doc && (doc.plans || (doc.fp16 && doc.fp16.plans));
  if (!doc || doc.format !== FORMAT || doc.version !== 1 || !Array.isArray(plans) || !plans.length) {
    throw fail(`the model file ${url} is not a leafpy web plan (format ${FORMAT}, version 1); export the model ` +
               "again with leafpy export --web");
  }
  return doc;
}

async function openAdapter(options) {
  if (!globalThis.navigator || !navigator.gpu) {
    throw fail("this browser has no WebGPU (navigator.gpu is missing): use a browser with WebGPU on (Chrome or " +
               "Edge 113+, Safari 26+, Firefox 141+), on a page served over https or from localhost");
  }
  const adapter = await navigator.gpu.requestAdapter(options.adapter || {powerPreference: "high-performance"});
  if (!adapter) {
    throw fail("navigator.gpu.requestAdapter() found no GPU adapter (WebGPU is present but no GPU is usable: " +
               "a blocklisted driver, or hardware acceleration turned off in the browser's settings)");
  }
  const info = adapter.info || {};
  const name = [info.vendor, info.architecture, info.device, info.description].filter(Boolean).join(" ");
  return {adapter, adapterName: name || "unknown adapter"};
}

const PRECISIONS = ["auto", "fp32", "fp16"];

// The precision to run at: "auto" takes the float16 plans where the model has them and the adapter offers
// "shader-f16" (WGSL's f16), else the float32 plans.
function choosePrecision(asked, doc, adapter, adapterName) {
  if (!PRECISIONS.includes(asked)) {
    throw fail(`load: precision must be one of ${PRECISIONS.map((p) => `"${p}"`).join(", ")}, got ` +
               `${JSON.stringify(asked)}`);
  }
  const have = Array.isArray(doc.precisions) ? doc.precisions : ["fp32"];
  const f16 = adapter.features.has("shader-f16");
  let want = asked;
  if (asked === "auto") want = (f16 && have.includes("fp16")) || !have.includes("fp32") ? "fp16" : "fp32";
  if (want === "fp16" && !f16) {
    throw fail(`load: precision "fp16" needs the GPU adapter's "shader-f16" feature (float16 in WGSL), which this ` +
               `adapter (${adapterName}) does not offer; load with {precision: "auto"} or "fp32"` +
               (have.includes("fp32") ? "" : ", after exporting the model again with --precision both"));
  }
  if (!have.includes(want)) {
    throw fail(`load: this model has no ${want} plans (plan.json lists ${have.join(", ")}); load with ` +
               `{precision: "auto"}, or export it again with leafpy export --web --precision both`);
  }
  return want;
}

async function openDevice(adapter, precision) {
  const limits = {};
  for (const name of ["maxStorageBufferBindingSize", "maxBufferSize", "maxComputeWorkgroupStorageSize"]) {
    if (adapter.limits[name] !== undefined) limits[name] = adapter.limits[name];
  }
  const requiredFeatures = precision === "fp16" ? ["shader-f16"] : [];
  return adapter.requestDevice({requiredLimits: limits, requiredFeatures});
}

async function compile(device, base, doc) {
  const modules = {};
  for (const [name, entry] of Object.entries(doc.modules)) {
    const code = new TextDecoder().decode(await checkedBytes(base, entry, `shader module ${name}`));
    const module = device.createShaderModule({code, label: name});
    const info = await module.getCompilationInfo();
    const errors = info.messages.filter((m) => m.type === "error");
    if (errors.length) {
      throw fail(`this browser's WGSL compiler rejects the shader module ${name}: ` +
                 errors.map((m) => `line ${m.lineNum}: ${m.message}`).join("; "));
    }
    modules[name] = module;
  }
  return modules;
}

function decode64(text) {
  const raw = atob(text);
  const out = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
  return out;
}

const STORAGE = () => GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_DST | GPUBufferUsage.COPY_SRC;

class Model {
  constructor(doc, device, adapterName, precision, modules, weights) {
    this.doc = doc;
    this.device = device;
    this.adapterName = adapterName;
    this.precision = precision;
    this.classes = doc.classes || [];
    this.normalization = doc.normalize || null;
    this.targetScale = doc.target || null;
    this.inputShape = doc.input_shape;
    this.outputKind = doc.output_kind;
    this.batchSizes = doc.plans.map((p) => p.batch).sort((a, b) => a - b);
    this._modules = modules;
    this._weightsBytes = weights;
    this._weights = {};
    this._pipelines = new Map();
    this._uniforms = new Map();
    this._plans = new Map();
    this._queue = Promise.resolve();
    for (const [name, t] of Object.entries(doc.weights.tensors)) {
      const buffer = device.createBuffer({size: Math.max(4, t.buffer_bytes), usage: STORAGE(), label: name});
      device.queue.writeBuffer(buffer, 0, weights, t.offset, t.bytes);
      this._weights[name] = buffer;
    }
  }

  async _pipeline(step) {
    const key = `${step.module}|${step.entry}|${JSON.stringify(step.constants)}`;
    let p = this._pipelines.get(key);
    if (!p) {
      const compute = {module: this._modules[step.module], entryPoint: step.entry};
      if (Object.keys(step.constants).length) compute.constants = step.constants;
      try {
        p = await this.device.createComputePipelineAsync({layout: "auto", compute});
      } catch (e) {
        throw fail(`cannot make the pipeline of ${step.module}.${step.entry}: ${e.message}`);
      }
      this._pipelines.set(key, p);
    }
    return p;
  }

  _uniform(params) {
    let u = this._uniforms.get(params);
    if (!u) {
      const bytes = decode64(params);
      u = this.device.createBuffer({size: bytes.byteLength, usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST});
      this.device.queue.writeBuffer(u, 0, bytes);
      this._uniforms.set(params, u);
    }
    return u;
  }

  async _plan(batch) {
    let ready = this._plans.get(batch);
    if (ready) return ready;
    const plan = this.doc.plans.find((p) => p.batch === batch);
    const buffers = {};
    for (const [label, size] of Object.entries(plan.buffers)) {
      buffers[label] = this.device.createBuffer({size: Math.max(4, size), usage: STORAGE(), label});
    }
    const find = (label) => (label.startsWith("w:") ? this._weights[label.slice(2)] : buffers[label]);
    const steps = [];
    for (const step of plan.steps) {
      if (step.write !== undefined) {
        const c = this.doc.weights.constants[step.constant];
        steps.push({write: find(step.write), offset: c.offset, bytes: c.bytes});
        continue;
      }
      const pipeline = await this._pipeline(step);
      const uniform = this._uniform(step.params);
      const entries = [{binding: 0, resource: {buffer: uniform}}];
      step.bindings.forEach(([label, offset, size], i) => {
        const buffer = find(label);
        const resource = offset === undefined ? {buffer} : {buffer, offset, size};
        entries.push({binding: i + 1, resource});
      });
      const group = this.device.createBindGroup({layout: pipeline.getBindGroupLayout(0), entries});
      steps.push({pipeline, group, grid: step.grid});
    }
    const outBytes = plan.output_shape.reduce((a, b) => a * b, 1) * 4;
    const staging = this.device.createBuffer({size: Math.max(4, outBytes),
                                              usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST});
    ready = {plan, buffers, steps, staging, outBytes};
    this._plans.set(batch, ready);
    return ready;
  }

  async _run(batch, x) {
    const {plan, buffers, steps, staging, outBytes} = await this._plan(batch);
    const device = this.device;
    device.pushErrorScope("validation");
    device.queue.writeBuffer(buffers.input, 0, x);
    let encoder = device.createCommandEncoder();
    let pass = encoder.beginComputePass();
    for (const s of steps) {
      if (s.write) {  // a constant written between dispatches: what came before runs first
        pass.end();
        device.queue.submit([encoder.finish()]);
        device.queue.writeBuffer(s.write, 0, this._weightsBytes, s.offset, s.bytes);
        encoder = device.createCommandEncoder();
        pass = encoder.beginComputePass();
        continue;
      }
      pass.setPipeline(s.pipeline);
      pass.setBindGroup(0, s.group);
      pass.dispatchWorkgroups(...s.grid);
    }
    pass.end();
    encoder.copyBufferToBuffer(buffers.output, 0, staging, 0, outBytes);
    device.queue.submit([encoder.finish()]);
    const error = await device.popErrorScope();
    if (error) throw fail(`the forward pass of ${plan.batch} samples failed on the GPU: ${error.message}`);
    await staging.mapAsync(GPUMapMode.READ);
    const out = new Float32Array(staging.getMappedRange().slice(0));
    staging.unmap();
    return out;
  }

  _pieces(n) {
    const sizes = this.batchSizes;
    const largest = sizes[sizes.length - 1];
    const pieces = [];
    for (let start = 0; start < n;) {
      const rest = n - start;
      const batch = rest >= largest ? largest : sizes.find((s) => s >= rest);
      const take = Math.min(batch, rest);
      pieces.push({start, take, batch});
      start += take;
    }
    return pieces;
  }

  _check(x, shape) {
    const want = this.inputShape;
    if (!Array.isArray(shape) || shape.length !== want.length + 1 ||
        !shape.every((d) => Number.isInteger(d) && d >= 0) || want.some((d, i) => shape[i + 1] !== d)) {
      throw fail(`predict: shape must be [N, ${want.join(", ")}] (N samples of the network's input), got ` +
                 `${JSON.stringify(shape)}`);
    }
    const data = x instanceof Float32Array ? x : Float32Array.from(x || []);
    const count = shape.reduce((a, b) => a * b, 1);
    if (data.length !== count) {
      throw fail(`predict: x holds ${data.length} values, but shape ${JSON.stringify(shape)} needs ${count}`);
    }
    return data;
  }

  /** The network's output for x (a Float32Array of shape [N, ...inputShape]): {data: Float32Array, shape}. */
  predict(x, shape) {
    const data = this._check(x, shape);
    const result = this._queue.then(() => this._predict(data, shape[0]));
    this._queue = result.catch(() => {});
    return result;
  }

  async _predict(x, n) {
    const per = this.inputShape.reduce((a, b) => a * b, 1);
    const first = this.doc.plans[0].output_shape;
    const perOut = first.slice(1).reduce((a, b) => a * b, 1);
    const out = new Float32Array(n * perOut);
    for (const {start, take, batch} of this._pieces(n)) {
      const chunk = new Float32Array(batch * per);
      chunk.set(x.subarray(start * per, (start + take) * per));
      const y = await this._run(batch, chunk);
      out.set(y.subarray(0, take * perOut), start * perOut);
    }
    return {data: out, shape: [n, ...first.slice(1)]};
  }

  /** Samples (a Float32Array, [N, C, ...]) normalised as the model was trained: (x - mean) / std per channel. */
  normalize(x, shape) {
    const norm = this.normalization;
    if (!norm) return Float32Array.from(x);
    const channels = shape.length > 1 ? shape[1] : 1;
    const inner = shape.slice(2).reduce((a, b) => a * b, 1);
    const out = new Float32Array(x.length);
    for (let i = 0; i < x.length; i++) {
      const c = norm.mean.length === 1 ? 0 : Math.floor(i / inner) % channels;
      out[i] = (x[i] - norm.mean[c]) / norm.std[c];
    }
    return out;
  }

  /** A regression's output {data, shape} in its targets' units: y * std + mean per output, where training
   * normalised the targets (`normalize: auto`); as given otherwise. What `leafpy predict` prints. */
  inUnits(y) {
    const t = this.targetScale;
    if (!t) return {data: Float32Array.from(y.data), shape: y.shape};
    const k = y.shape.length > 1 ? y.shape[1] : 1;
    const inner = y.shape.slice(2).reduce((a, b) => a * b, 1);
    const data = new Float32Array(y.data.length);
    for (let i = 0; i < data.length; i++) {
      const c = t.mean.length === 1 ? 0 : Math.floor(i / inner) % k;
      data[i] = y.data[i] * t.std[c] + t.mean[c];
    }
    return {data, shape: y.shape};
  }

  /** Class probabilities per sample from an output {data, shape} of shape [N, classes]. */
  probabilities(y) {
    const [n, k] = y.shape;
    const out = new Float32Array(n * k);
    for (let r = 0; r < n; r++) {
      const row = y.data.subarray(r * k, (r + 1) * k);
      if (this.outputKind === "probabilities") {
        out.set(row, r * k);
        continue;
      }
      const top = Math.max(...row);
      let sum = 0;
      for (let j = 0; j < k; j++) sum += (out[r * k + j] = Math.exp(row[j] - top));
      for (let j = 0; j < k; j++) out[r * k + j] /= sum;
    }
    return out;
  }

  destroy() {
    this.device.destroy();
  }
}

/** Load an exported model from the folder at url (e.g. "./model/"): fetch and check its files, compile its shader
 * modules and make every plan's pipelines, buffers and bind groups. options.precision: "auto" (the default: the
 * model's float16 plans where the adapter offers "shader-f16" and the export has them, else float32), "fp32" or
 * "fp16"; the model's precision says which it runs. Inputs and outputs are float32 either way. */
export async function load(url, options = {}) {
  const {adapter, adapterName} = await openAdapter(options);
  const base = new URL(url.endsWith("/") ? url : url + "/", globalThis.location ? location.href : undefined);
  const doc = await readPlan(base);
  const precision = choosePrecision(options.precision ?? "auto", doc, adapter, adapterName);
  const variant = precision === "fp32" ? doc : {...doc, ...doc[precision]};  // its plans, modules and weights
  const device = await openDevice(adapter, precision);
  const weights = await checkedBytes(base, variant.weights, "the weights");
  const modules = await compile(device, base, variant);
  const model = new Model(variant, device, adapterName, precision, modules, weights);
  for (const batch of model.batchSizes) await model._plan(batch);  // pipelines compiled now, not in predict()
  return model;
}
