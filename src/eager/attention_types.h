/* attention_impl.h for both float types at one vector width (attention.c
 * sets AT_ISA, AT_VB and AT_TARGET around each include). */
#define AT float
#define AT_SFX f32
#define AT_EXP vm_expf
#define AT_LOG logf
#include "eager/attention_impl.h"
#undef AT
#undef AT_SFX
#undef AT_EXP
#undef AT_LOG
#define AT double
#define AT_SFX f64
#define AT_EXP exp
#define AT_LOG log
#include "eager/attention_impl.h"
#undef AT
#undef AT_SFX
#undef AT_EXP
#undef AT_LOG
