// The records of tensors that the host checks compare (Note [Exact views]), shared by
// py_checks.cpp (the identity test of Note [Fused state coherence]) and py_flat.cpp (the
// flat-gradient handles), and the Python entry points the two define for module.cpp's
// method table. CPython API: only here, in module.cpp, the py_*.cpp files and
// cpu/dispatch.cpp / cpu/kernels/isa_module.cpp (docs/building.md).
#pragma once

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <vector>

namespace ruda::py {

// A contiguous CPU int64 tensor's data (null when empty) and size; false with a Python
// error set for anything else (`name` says which argument of which function).
inline bool int64_data(PyObject* obj, const char* name, int64_t** data, int64_t* numel) {
  if (THPVariable_Check(obj)) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (t.scalar_type() == at::kLong && t.is_cpu() && t.is_contiguous()) {
      *numel = t.numel();
      *data = *numel > 0 ? t.data_ptr<int64_t>() : nullptr;
      return true;
    }
  }
  PyErr_Format(PyExc_TypeError, "%s must be a contiguous CPU int64 tensor", name);
  return false;
}

// What unchanged() compares of a parameter: dtype, device, shape and strides (any change
// re-derives the plan: the bucket holds state of that dtype, on that device, in that
// memory order). Appends [dtype, device type, device index, dim, sizes..., strides...];
// false for anything that is not a tensor with concrete sizes.
inline void append_layout_of(const at::Tensor& t, std::vector<int64_t>& out) {
  out.push_back(static_cast<int64_t>(t.scalar_type()));
  out.push_back(static_cast<int64_t>(t.device().type()));
  out.push_back(static_cast<int64_t>(t.device().index()));
  out.push_back(t.dim());
  out.insert(out.end(), t.sizes().begin(), t.sizes().end());
  out.insert(out.end(), t.strides().begin(), t.strides().end());
}

// Whether `t` (or `obj`) still has the layout append_layout() recorded at *want; advances
// *want past it. Compared in place: unchanged() runs it for every fused parameter at every
// step.
inline bool same_layout_of(const c10::TensorImpl& t, const int64_t** want, const int64_t* end) {
  if (t.has_symbolic_sizes_strides()) return false;
  const int64_t dim = t.dim();
  const int64_t* w = *want;
  if (end - w < 4 + 2 * dim || w[0] != static_cast<int64_t>(t.dtype().toScalarType()) ||
      w[1] != static_cast<int64_t>(t.device().type()) ||
      w[2] != static_cast<int64_t>(t.device().index()) || w[3] != dim) {
    return false;
  }
  w += 4;
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (int64_t d = 0; d < dim; ++d) {
    if (w[d] != sizes[d] || w[dim + d] != strides[d]) return false;
  }
  *want = w + 2 * dim;
  return true;
}

// Note [Exact views]
// A view of a bucket buffer (a state view in optimizer.state, a flat gradient view that
// is `p.grad`) is what the step reads and writes. Whether it still is that view is a fact
// about the tensor object, and is checked as such: the storage it addresses (the
// StorageImpl, which the bucket keeps alive, so an equal pointer is the same memory), its
// storage offset, dtype, device, sizes and strides. `view.data = t`, `set_`, `t_()`,
// `resize_`, `unsqueeze_` all change one of these in the same TensorImpl, whatever other
// tensors share the buffer (a sharing count, the proxy used before, missed a replaced
// view while some other tensor kept a reference). All of it lives in the TensorImpl: one
// object per view, prefetched like the others, no second pointer chase.

// Note [Tensors of their own]
// The views that the state and the flat gradients hold are tensors of their own over the
// bucket's memory (`torch.empty(0).set_(storage, offset, sizes, strides)`), not views in
// autograd's sense, and a bucket makes those of many slots one after another before it
// puts any into an entry (Bucket.own_views, then install). Both are for the checks of
// py_checks.cpp and py_flat.cpp,
// which read every one of them at every step: an autograd view allocates its view
// metadata between the TensorImpls, and a slot made while the entry it replaces is freed
// lands in that entry's scattered memory, so the 60,000 state views of 20,000 parameters
// spread over 9,000 pages and cost 86 ns each to check; made as here, 2,950 pages and
// 20 ns. Like torch's own AdamW state, they have no `_base`, and each its own version
// counter (a flat gradient view needs that: Note [Flat gradient buckets]).
inline void append_view(const at::Tensor& t, std::vector<int64_t>& out) {
  out.push_back(static_cast<int64_t>(
      reinterpret_cast<uintptr_t>(t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr)));
  out.push_back(t.has_storage() ? t.storage_offset() : 0);
}

// Whether TensorImpl `t` is still the view that append_view() + append_layout_of() recorded
// at *want; advances *want past the record. Reads the TensorImpl alone (same_views runs it
// on worker threads).
inline bool same_view_impl(const c10::TensorImpl& t, const int64_t** want, const int64_t* end) {
  const int64_t* w = *want;
  if (end - w < 2) return false;
  const auto storage = static_cast<int64_t>(reinterpret_cast<uintptr_t>(
      t.has_storage() ? t.unsafe_storage().unsafeGetStorageImpl() : nullptr));
  if (w[0] != storage || w[1] != (t.has_storage() ? t.storage_offset() : 0)) return false;
  w += 2;
  if (!same_layout_of(t, &w, end)) return false;
  *want = w;
  return true;
}

// py_checks.cpp
PyObject* layout_record(PyObject*, PyObject* tensors);
PyObject* view_record(PyObject*, PyObject* tensors);
PyObject* unchanged(PyObject*, PyObject* args);
PyObject* grads_of(PyObject*, PyObject* params);

// py_flat.cpp (Note [Flat gradient buckets] in csrc/bindings.h)
PyObject* flat_bucket(PyObject*, PyObject* args);
PyObject* flat_check(PyObject*, PyObject* args);
PyObject* flat_mark(PyObject*, PyObject* args);
PyObject* flat_analyze(PyObject*, PyObject* args);
PyObject* flat_step(PyObject*, PyObject* args);

}  // namespace ruda::py
