// The three frameworks timed by benchmarks/web_inference.py, in one page: leafpy.js (an export --web folder),
// TensorFlow.js on its WebGPU backend (the network rebuilt with tf.layers from tfjs.json + tfjs.bin) and
// onnxruntime-web on its WebGPU execution provider (model.onnx). Each run(): load, `warmup` untimed predictions,
// then `repeats` timed ones; a prediction is input upload, forward pass and the output read back to the CPU.
//
// Served from a folder holding node_modules/ (npm ci in benchmarks/web) and, per network, NAME/ with leafpy/,
// model.onnx, tfjs.json, tfjs.bin, input.bin (NCHW) and input_nhwc.bin (the same samples, NHWC for tfjs).

async function bytes(url) {
  const r = await fetch(url);
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.arrayBuffer();
}

async function timed(predict, warmup, repeats) {
  let out;
  for (let i = 0; i < warmup; i++) out = await predict();
  const ms = [];
  for (let i = 0; i < repeats; i++) {
    const t = performance.now();
    out = await predict();
    ms.push(performance.now() - t);
  }
  return {ms, output: Array.from(out)};
}

async function leafpy(dir, spec, warmup, repeats) {
  const {load} = await import(`${dir}leafpy/leafpy.js`);
  const m = await load(`${dir}leafpy/model/`);
  try {
    const x = new Float32Array(await bytes(`${dir}input.bin`));
    const r = await timed(async () => (await m.predict(x, spec.input_shape)).data, warmup, repeats);
    return {...r, adapter: m.adapterName};
  } finally {
    m.destroy();
  }
}

function script(src) {
  return new Promise((resolve, reject) => {
    const s = document.createElement("script");
    s.src = src;
    s.onload = resolve;
    s.onerror = () => reject(new Error(`cannot load ${src}: run npm ci in benchmarks/web`));
    document.head.appendChild(s);
  });
}

async function tensorflow() {
  if (!globalThis.tf) {
    await script("/node_modules/@tensorflow/tfjs/dist/tf.min.js");
    await script("/node_modules/@tensorflow/tfjs-backend-webgpu/dist/tf-backend-webgpu.min.js");
  }
  if (!(await tf.setBackend("webgpu"))) throw new Error("TensorFlow.js: the webgpu backend did not start");
  await tf.ready();
  return tf;
}

// One leafpy layer as tf.layers (NHWC): the layers made, the tf.layers output, and the weights they take.
function tfLayer(tf, layer, inputs, weight) {
  const made = [];
  const use = (l, x, weights) => {
    made.push([l, weights]);
    return l.apply(x);
  };
  const [x] = inputs;
  switch (layer.type) {
    case "Convolution": {
      const [ph, pw] = layer.padding;
      const padded = ph || pw ? use(tf.layers.zeroPadding2d({padding: [[ph, ph], [pw, pw]]}), x, []) : x;
      const weights = [weight("weight"), ...(layer.bias ? [weight("bias")] : [])];
      return [use(tf.layers.conv2d({filters: layer.num_output, kernelSize: layer.filter_shape,
                                    strides: layer.stride, padding: "valid", useBias: layer.bias}), padded, weights),
              made];
    }
    case "BatchNorm":
      return [use(tf.layers.batchNormalization({axis: -1, epsilon: layer.eps}), x,
                  ["weight", "bias", "running_mean", "running_var"].map(weight)), made];
    case "ReLU":
      return [use(tf.layers.reLU(), x, []), made];
    case "Pooling": {
      const make = layer.mode === "max" ? tf.layers.maxPooling2d : tf.layers.averagePooling2d;
      return [use(make({poolSize: layer.filter_shape, strides: layer.stride, padding: "valid"}), x, []), made];
    }
    case "Eltwise":
      return [use(tf.layers.add(), inputs, []), made];
    case "Flatten":
      return [use(tf.layers.flatten(), x, []), made];
    case "Linear":
      return [use(tf.layers.dense({units: layer.output_size, useBias: layer.bias}), x,
                  [weight("weight"), ...(layer.bias ? [weight("bias")] : [])]), made];
    default:
      throw new Error(`TensorFlow.js: no tf.layers form for ${layer.type} (${layer.name})`);
  }
}

async function tfModel(tf, dir, spec) {
  const blob = await bytes(`${dir}tfjs.bin`);
  const [n, c, h, w] = spec.input_shape;
  const blobs = {[spec.input]: tf.input({batchShape: [n, h, w, c]})};
  const pending = [];
  for (const layer of spec.layers) {
    const weight = (k) => {
      const t = spec.weights[`${layer.name}/${k}`];
      return tf.tensor(new Float32Array(blob, t.offset, t.size), t.shape);
    };
    const [y, made] = tfLayer(tf, layer, layer.inputs.map((b) => blobs[b]), weight);
    blobs[layer.output] = y;
    pending.push(...made);
  }
  const model = tf.model({inputs: blobs[spec.input], outputs: blobs[spec.output]});
  for (const [l, weights] of pending) if (weights.length) l.setWeights(weights);
  tf.dispose(pending.flatMap(([, weights]) => weights));
  return model;
}

async function tensorflowjs(dir, spec, warmup, repeats) {
  const tf = await tensorflow();
  const model = await tfModel(tf, dir, spec);
  const [n, c, h, w] = spec.input_shape;
  const x = new Float32Array(await bytes(`${dir}input_nhwc.bin`));
  const predict = async () => {
    const y = tf.tidy(() => {
      const out = model.predict(tf.tensor4d(x, [n, h, w, c]));
      return spec.log_softmax ? tf.logSoftmax(out) : out;
    });
    try {
      return await y.data();
    } finally {
      y.dispose();
    }
  };
  try {
    const r = await timed(predict, warmup, repeats);
    const info = tf.backend().adapterInfo || {};
    return {...r, adapter: [info.vendor, info.architecture].filter(Boolean).join(" "), backend: tf.getBackend()};
  } finally {
    model.dispose();
  }
}

async function onnxruntime(dir, spec, warmup, repeats) {
  const ort = await import("/node_modules/onnxruntime-web/dist/ort.webgpu.min.mjs");
  ort.env.wasm.numThreads = 1;  // the page is not cross-origin isolated: no wasm threads
  // leafpy's ONNX export leaves the batch dimension open as "N": fixed here, as a page that knows its batch would
  const session = await ort.InferenceSession.create(`${dir}model.onnx`, {
    executionProviders: ["webgpu"], freeDimensionOverrides: {N: spec.input_shape[0]}});
  const x = new Float32Array(await bytes(`${dir}input.bin`));
  const predict = async () => {
    const feeds = {[session.inputNames[0]]: new ort.Tensor("float32", x, spec.input_shape)};
    const out = (await session.run(feeds))[session.outputNames[0]];
    try {
      return out.data;  // on the CPU: read back from the GPU
    } finally {
      out.dispose();
    }
  };
  try {
    const r = await timed(predict, warmup, repeats);
    const device = await ort.env.webgpu.device;  // set once a session runs on the WebGPU provider
    const info = (device && device.adapterInfo) || (ort.env.webgpu.adapter && ort.env.webgpu.adapter.info) || {};
    return {...r, adapter: [info.vendor, info.architecture].filter(Boolean).join(" ")};
  } finally {
    await session.release();
  }
}

const FRAMEWORKS = {"leafpy.js": leafpy, "tfjs-webgpu": tensorflowjs, "ort-web-webgpu": onnxruntime};

/** Time `framework` on the network in the served folder `dir` ("/lenet64/"). */
export async function run(framework, dir, warmup, repeats) {
  const spec = JSON.parse(new TextDecoder().decode(await bytes(`${dir}tfjs.json`)));
  return FRAMEWORKS[framework](dir, spec, warmup, repeats);
}

/** The adapter a page gets by default: its name and whether it is a fallback (software) adapter. */
export async function adapter() {
  const a = await navigator.gpu.requestAdapter();
  if (!a) return {name: "none", fallback: false};
  const i = a.info || {};
  return {name: [i.vendor, i.architecture, i.device, i.description].filter(Boolean).join(" "),
          fallback: Boolean(i.isFallbackAdapter ?? a.isFallbackAdapter)};
}
