// Compiles shader modules under the browser's WebGPU (Chrome: Tint) and makes a compute pipeline of each entry
// point, for tests/test_browser_wgsl.py. Modules come as JSON: [{name, variant, code, entries, f16, subgroups}].

// A GPUDevice with the optional features the adapter offers (shader-f16, subgroups) and a description of it.
export async function openDevice(optional = ["shader-f16", "subgroups"]) {
  if (!navigator.gpu) throw new Error("this browser exposes no WebGPU (navigator.gpu is undefined)");
  const adapter = await navigator.gpu.requestAdapter();
  if (!adapter) throw new Error("navigator.gpu.requestAdapter() gave no adapter");
  const features = optional.filter((f) => adapter.features.has(f));
  const device = await adapter.requestDevice({requiredFeatures: features});
  const info = adapter.info || {};
  return {
    device,
    adapter: {
      vendor: info.vendor, architecture: info.architecture, device: info.device, description: info.description,
      fallback: Boolean(info.isFallbackAdapter ?? adapter.isFallbackAdapter), features: [...adapter.features].sort(),
      maxStorageBufferBindingSize: adapter.limits.maxStorageBufferBindingSize,
    },
    features,
  };
}

function quote(code, message) {
  const line = code.split("\n")[message.lineNum - 1] ?? "";
  return `${message.type} at ${message.lineNum}:${message.linePos}: ${message.message}\n    ${line.trim()}`;
}

// Each module compiled and each entry point's pipeline made. A module whose variant needs a feature the device
// lacks is skipped (subgroups), or (f16 without shader-f16) only checked to fail for want of the f16 extension.
export async function compileAll(url) {
  const {device, adapter, features} = await openDevice();
  const modules = await (await fetch(url)).json();
  const result = {adapter, features, compiled: {}, skipped: {}, parsedOnly: {}, failures: []};
  const count = (table, variant, n) => { table[variant] = (table[variant] || 0) + n; };
  // every module at once: the browser compiles them on its own threads
  await Promise.all(modules.map(async (m) => {
    if (m.subgroups && !features.includes("subgroups")) { count(result.skipped, m.variant, m.entries.length); return; }
    const noF16 = m.f16 && !features.includes("shader-f16");
    device.pushErrorScope("validation");  // pushed, used and popped in one go: the scopes of others never interleave
    const module = device.createShaderModule({code: m.code, label: m.name});
    const popped = device.popErrorScope();
    const [info, scope] = await Promise.all([module.getCompilationInfo(), popped]);
    const messages = info.messages;
    const errors = messages.filter((x) => x.type === "error");
    if (errors.some((x) => !(noF16 && /\bf16\b/.test(x.message))) || (scope && !errors.length)) {
      // the errors with the compiler's notes (where a non-uniform value came from, ...)
      const told = messages.filter((x) => x.type !== "warning").map((x) => quote(m.code, x)).join("\n");
      result.failures.push({module: m.name, variant: m.variant, entry: null, message: told || scope.message});
      return;
    }
    if (noF16) { count(result.parsedOnly, m.variant, m.entries.length); return; }
    await Promise.all(m.entries.map(async (entry) => {
      try {
        await device.createComputePipelineAsync({layout: "auto", compute: {module, entryPoint: entry}});
        count(result.compiled, m.variant, 1);
      } catch (e) {
        result.failures.push({module: m.name, variant: m.variant, entry, message: String(e.message || e)});
      }
    }));
  }));
  device.destroy();
  return result;
}
