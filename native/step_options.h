// The options of a step that its kernels take, as one struct per kind of op (kernels.h), written once as
// F(type, name) lists. A step's descriptor (steps.h) holds the same fields (its list includes this one), so a new
// option is a field here, its Python field (compute/steps.py) and the kernel that reads it; compute/step_binding.py
// fills both structs by name and checks them against compute/steps.py when the extension loads.
#pragma once

#include <cstdint>

#define DECLARE_STEP_FIELD(type, name) type name{};
#define COPY_STEP_FIELD(type, name) out.name = name;

// the attention kernels' options: scale of q . k; softcap > 0 (Gemma 2): each score s becomes
// softcap * tanh(s / softcap) before any bias; window > 0 (Gemma 2's sliding layers): only the last `window` keys
// (the query's own included) are attended and read. softcap 0 / window 0: as without them, bit for bit.
#define ATTENTION_OPTION_FIELDS(F) F(double, scale) F(double, softcap) F(int64_t, window)

struct AttentionOptions {
  ATTENTION_OPTION_FIELDS(DECLARE_STEP_FIELD)
  void check() const;
};
