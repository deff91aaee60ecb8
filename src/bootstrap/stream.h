/* bootstrap/stream.h: the process's kept CUDA streams (hep_inproc_stream), one table per
 * device. Slots 0..HEP_INPROC_MAX_RANKS-1 are the virtual ranks'; the loopback NIC's copy
 * streams take the HEP_STREAM_NIC_SLOTS above them. */
#ifndef HEP_BOOTSTRAP_STREAM_H
#define HEP_BOOTSTRAP_STREAM_H

#include <stddef.h>

#include "hybridep/bootstrap.h"

#define HEP_STREAM_NIC_SLOTS 16 /* NICs of ranks 16 apart share a copy stream */
#define HEP_STREAM_NIC_SLOT0 HEP_INPROC_MAX_RANKS
#define HEP_STREAM_SLOTS (HEP_STREAM_NIC_SLOT0 + HEP_STREAM_NIC_SLOTS)

/* The kept stream of `slot` on `device` (*out: a cudaStream_t), made on first use; `who`
 * opens the error message. 0 or a hep_status with hep_last_error() set. */
int hep_kept_stream(int device, int slot, const char *who, void **out);

/* The hardware queues a process gets on a GPU (CUDA_DEVICE_MAX_CONNECTIONS, 1..32; 8 when
 * unset or out of range), and how many kept streams `device` has now. */
int hep_stream_queues(void);
int hep_kept_streams(int device);

/* A timeout message's note when `kept_n` kept streams on `device` take every one of its
 * `queues` hardware queues: written to buf (empty otherwise); 1 when written. */
int hep_stream_queue_note(char *buf, size_t len, int device, int kept_n, int queues);

#endif
