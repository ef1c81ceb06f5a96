#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>
namespace at { using c10::BFloat16; using c10::Half; inline int get_num_threads(){return omp_get_max_threads();} }
