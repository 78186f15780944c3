@0x8316e0f30c445924;

# leafpy's file format: models (Layer) and solver checkpoints (SolverCheckpoint), packed encoding.
# Everything Leaf 0.2.1 wrote keeps its struct, field name and ordinal, so Leaf's files load; leafpy's additions
# come after them, with defaults under which a Leaf file means what it meant in Leaf (a missing bias field reads
# as "no bias", as Leaf's Linear and Convolution had none).

struct Weight {
  name @0 :Text;
  tensor @1 :Tensor;
}

struct Tensor {
  shape @0 :List(UInt64);
  data @1 :List(Float32);   # Leaf's way
  raw @2 :Data;             # leafpy's format 1: the values as little-endian float32 bytes (data is then empty)
  offset @3 :UInt64;        # format 2 (raw and data empty): where the values, little-endian float32 bytes, begin
                            # in the raw section that follows the message in the file
}

struct Layer {
  name @0 :Text;
  config @1 :LayerConfig;
  weightsData @2 :List(Weight);
  preparation @3 :Text;     # how the model reads data (JSON: class names, normalisation); empty: none
}

struct LayerConfig {
  name @0 :Text;
  layerType :union {
    # Common layers
    convolution @1 :ConvolutionConfig;
    linear @2 :LinearConfig;
    logSoftmax @3 :Void;
    pooling @4 :PoolingConfig;
    sequential @5 :SequentialConfig;
    softmax @6 :Void;
    # Activation layers
    relu @7 :Void;
    sigmoid @8 :Void;
    # Loss layers
    negativeLogLikelihood @9 :NegativeLogLikelihoodConfig;
    # Utility layers
    reshape @10 :ReshapeConfig;
    # leafpy's layer types
    tanh @15 :Void;
    dropout @16 :DropoutConfig;
    flatten @17 :Void;
    meanSquaredError @18 :Void;
    batchNorm @19 :BatchNormConfig;
    eltwise @20 :EltwiseConfig;
    concat @21 :ConcatConfig;
    slice @22 :SliceConfig;
    lrn @23 :LRNConfig;
    leakyRelu @24 :LeakyReLUConfig;
    elu @25 :ELUConfig;
    gelu @26 :GELUConfig;
    softplus @27 :SoftplusConfig;
    silu @28 :Void;
    # sequences
    embedding @29 :EmbeddingConfig;
    lstm @30 :RecurrentConfig;
    rnn @31 :RecurrentConfig;
    gru @32 :RecurrentConfig;
    swish @33 :Void;          # SiLU under its other name
    # the types above stored as Void (as Leaf had them) with settings other than their defaults
    softmaxConfig @34 :AxisConfig;
    logSoftmaxConfig @35 :AxisConfig;
    flattenConfig @36 :AxisConfig;
    deconvolution @37 :DeconvolutionConfig;
    softmaxCrossEntropy @38 :NegativeLogLikelihoodConfig;
    clip @39 :ClipConfig;
    transpose @40 :TransposeConfig;
    matMul @41 :MatMulConfig;
  }

  outputs @11 :List(Text);
  inputs @12 :List(Text);
  params @13 :List(WeightConfig);
  propagateDown @14 :List(Bool);
}

struct WeightConfig {
  name @0 :Text;            # empty: not shared
  lrMult @1 :Float64 = 1.0;
  decayMult @2 :Float64 = 1.0;
  filler @3 :FillerConfig;  # absent: the layer's default
}

struct FillerConfig {
  type @0 :FillerType;
  value @1 :Float64;
  std @2 :Float64 = 0.01;
}

enum FillerType {
  glorotUniform @0;
  constant @1;
  gaussian @2;
  he @3;
}

struct ConvolutionConfig {
  numOutput @0 :UInt64;
  filterShape @1 :List(UInt64);
  stride @2 :List(UInt64);
  padding @3 :List(UInt64);     # before each spatial dimension (and after it, unless padEnd says otherwise)
  bias @4 :Bool;
  dilation @5 :List(UInt64);    # empty: 1 (no dilation)
  group @6 :UInt64 = 1;
  padEnd @7 :List(UInt64);      # after each spatial dimension; empty: as padding
}

struct DeconvolutionConfig {  # a transposed convolution: weight [C, numOutput / group, kh, kw]
  numOutput @0 :UInt64;
  filterShape @1 :List(UInt64);
  stride @2 :List(UInt64);
  padding @3 :List(UInt64);
  padEnd @4 :List(UInt64);         # empty: as padding
  outputPadding @5 :List(UInt64);  # empty: 0
  dilation @6 :List(UInt64);       # empty: 1
  group @7 :UInt64 = 1;
  bias @8 :Bool = true;
}

struct LinearConfig {
  outputSize @0 :UInt64;
  bias @1 :Bool;
  axis @2 :Int64 = 1;       # the first feature axis; the axes before it are kept (-1: per time step)
}

struct PoolingConfig {
  mode @0 :PoolingMode;
  filterShape @1 :List(UInt64);
  stride @2 :List(UInt64);
  padding @3 :List(UInt64);     # before each spatial dimension (and after it, unless padEnd says otherwise)
  padEnd @4 :List(UInt64);      # after each spatial dimension; empty: as padding
  ceilMode @5 :Bool;            # output sizes rounded up (Caffe's pooling), not down
  countIncludePad @6 :Bool = true;  # average pooling divides by the window's size padding included
  globalPooling @7 :Bool;       # one window over the whole input (filter, stride and padding unused)
}

enum PoolingMode {
  max @0;
  average @1;
}

struct SequentialConfig {
  layers @0 :List(LayerConfig);
  inputs @1 :List(ShapedInput);
  forceBackward @2 :Bool;
}

struct ShapedInput {
  name @0 :Text;
  shape @1 :List(UInt64);
}

enum LossReduction {
  mean @0;
  sum @1;
  none @2;
}

struct NegativeLogLikelihoodConfig {  # and SoftmaxCrossEntropy's
  numClasses @0 :UInt64;
  reduction @1 :LossReduction = mean;
  ignoreIndex @2 :List(Int64);   # empty: every label counts; else the one label whose samples are left out
  weight @3 :List(Float64);      # one per class; empty: all 1
  logProb @4 :Bool;              # SoftmaxCrossEntropy: the log-probabilities as a second output
}

struct ReshapeConfig {
  shape @0 :List(UInt64);   # 0 after the batch dimension: inferred (leafpy's -1)
  wholeShape @1 :Bool;      # shape is the whole output shape, its first entry too (0 there: inferred)
}

struct MatMulConfig {
  weightShape @0 :List(UInt64);  # empty: b is the second input; else b is the layer's weight of this shape
}

struct TransposeConfig {
  perm @0 :List(UInt64);    # every axis, the batch (0) included, in the output's order
}

struct AxisConfig {           # Softmax, LogSoftmax, Flatten
  axis @0 :Int64 = 1;         # negative counts from the end
}

struct DropoutConfig {
  ratio @0 :Float64;
  maskOutput @1 :Bool;          # a second output: 1 where the value is kept (all 1 in inference)
}

enum EltwiseOperation {
  prod @0;
  sum @1;
  max @2;
}

struct EltwiseConfig {
  operation @0 :EltwiseOperation = sum;
  coeff @1 :List(Float64);  # sum: one per input; empty: all 1
  weightShape @2 :List(UInt64);  # empty: no weight operand; else one more operand, the layer's weight
}

struct ConcatConfig {
  axis @0 :Int64 = 1;
}

struct SliceConfig {
  axis @0 :Int64 = 1;
  slicePoints @1 :List(UInt64);
}

struct LRNConfig {
  localSize @0 :UInt64 = 5;
  alpha @1 :Float64 = 1.0;
  beta @2 :Float64 = 0.75;
  k @3 :Float64 = 1.0;
}

struct BatchNormConfig {
  eps @0 :Float64 = 1e-5;
  momentum @1 :Float64 = 0.1;
  affine @2 :Bool = true;
}

# Solver checkpoints

struct SolverConfig {
  name @0 :Text;
  network @1 :LayerConfig;
  objective @2 :LayerConfig;
  solver @3 :Text;
  minibatchSize @4 :UInt64;
  lrPolicy @5 :Text;
  baseLr @6 :Float64;
  gamma @7 :Float64;
  stepsize @8 :UInt64;
  stepvalues @9 :List(UInt64);
  power @10 :Float64;
  maxIter @11 :UInt64;        # 0: none
  clipGradients @12 :Float64; # 0: no clipping
  weightDecay @13 :Float64;   # 0: none
  momentum @14 :Float64;
  beta1 @15 :Float64;
  beta2 @16 :Float64;
  epsilon @17 :Float64;
  rmsDecay @18 :Float64;
  seed @19 :Int64 = -1;       # -1: none
  lossScale @20 :Text;        # "": dynamic under fp16, none otherwise; "dynamic", "none" or a static scale
  lossScaleInit @21 :Float64 = 65536.0;
  lossScaleGrowthFactor @22 :Float64 = 2.0;
  lossScaleBackoffFactor @23 :Float64 = 0.5;
  lossScaleGrowthInterval @24 :UInt64 = 2000;
  minLr @25 :Float64;         # the cosine policy's rate at maxIter
  warmupIter @26 :UInt64;     # a linear warm-up over the first warmupIter iterations (0: none)
  warmupFactor @27 :Float64;  # from warmupFactor times the rate at warmupIter
}

struct SolverCheckpoint {
  config @0 :SolverConfig;
  network @1 :Layer;
  iteration @2 :UInt64;
  state @3 :List(Weight);        # update-rule history, named "{weight}#{state}"
  pendingCalls @4 :UInt64;       # gradient accumulation: calls since the last update
  accumulated @5 :List(Weight);  # and their summed gradients
  rngSeeds @6 :List(UInt64);     # per random layer (dropout), in network order: its seed
  rngCalls @7 :List(UInt64);     # and how many masks it has drawn
  trainerState @8 :Text;         # the training loop's own position (JSON object; empty: none)
  lossScale @9 :Float64;         # fp16 loss scaling: the scale (0: no scaling, as before it existed)
  lossScaleGoodSteps @10 :UInt64;  # updates with finite gradients since the scale last changed
  skippedSteps @11 :UInt64;      # updates skipped for inf or nan gradients
}

struct EmbeddingConfig {
  inputDim @0 :UInt64;      # how many ids
  outputDim @1 :UInt64;     # the length of each id's vector
}

struct RecurrentConfig {     # LSTM, RNN and GRU
  hiddenSize @0 :UInt64;
  returnSequences @1 :Bool = true;
  returnCellState @2 :Bool;     # LSTM: a second output, the last step's cell state
  linearBeforeReset @3 :Bool = true;  # GRU: false applies the reset gate before the product (ONNX's default)
}

struct LeakyReLUConfig {
  negativeSlope @0 :Float64 = 0.01;
}

struct ELUConfig {
  alpha @0 :Float64 = 1.0;
}

enum GeluApproximation {
  none @0;   # x * Phi(x), through erf
  tanh @1;   # the tanh approximation
}

struct GELUConfig {
  approximate @0 :GeluApproximation = none;
}

struct SoftplusConfig {
  beta @0 :Float64 = 1.0;
  threshold @1 :Float64 = 20.0;
}

struct ClipConfig {
  lower @0 :Float64 = 0.0;
  upper @1 :Float64 = 6.0;
}
