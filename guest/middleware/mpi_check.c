// SPDX-License-Identifier: GPL-2.0 OR BSD-2-Clause
/*
 * mpi_check: an MPI ping-pong, an allreduce and a bandwidth test between two
 * ranks, every byte checked. Built in the middleware guest images
 * (scripts/middleware/image.sh) with the guest's own mpicc and run by
 * scripts/middleware/matrix.sh under `mpirun --mca pml ucx` across two guests.
 *
 * Prints one line per test ("pingpong 8 B half-rtt 12.3 us", ...) and exits
 * non-zero when any received byte or reduced value is not what was sent.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_MSG		(1 << 20)
#define BW_WINDOW	16
#define BW_ROUNDS	8
#define RED_COUNT	65536

/* the byte a sender puts at offset i of message number seq */
static uint8_t pattern(uint32_t seq, size_t i)
{
	return (uint8_t)(seq * 131 + i * 7 + (i >> 8));
}

static void fill(uint8_t *buf, size_t len, uint32_t seq)
{
	size_t i;

	for (i = 0; i < len; i++)
		buf[i] = pattern(seq, i);
}

/* the number of bytes of buf that differ from message seq */
static size_t check(const uint8_t *buf, size_t len, uint32_t seq)
{
	size_t i, bad = 0;

	for (i = 0; i < len; i++)
		if (buf[i] != pattern(seq, i))
			bad++;
	return bad;
}

static int pingpong(int rank, uint8_t *buf, size_t len, int iters)
{
	int peer = !rank, i, errors = 0;
	double t0, t1;

	MPI_Barrier(MPI_COMM_WORLD);
	t0 = MPI_Wtime();
	for (i = 0; i < iters; i++) {
		uint32_t seq = (uint32_t)(len + i);

		if (rank == 0) {
			fill(buf, len, seq);
			MPI_Send(buf, (int)len, MPI_BYTE, peer, 1, MPI_COMM_WORLD);
			memset(buf, 0, len);
			MPI_Recv(buf, (int)len, MPI_BYTE, peer, 2, MPI_COMM_WORLD,
				 MPI_STATUS_IGNORE);
			if (check(buf, len, seq + 1))
				errors++;
		} else {
			memset(buf, 0, len);
			MPI_Recv(buf, (int)len, MPI_BYTE, peer, 1, MPI_COMM_WORLD,
				 MPI_STATUS_IGNORE);
			if (check(buf, len, seq))
				errors++;
			fill(buf, len, seq + 1);
			MPI_Send(buf, (int)len, MPI_BYTE, peer, 2, MPI_COMM_WORLD);
		}
	}
	t1 = MPI_Wtime();
	if (rank == 0)
		printf("pingpong %zu B half-rtt %.2f us (%d iterations)\n", len,
		       (t1 - t0) * 1e6 / (2.0 * iters), iters);
	return errors;
}

static int allreduce(int rank, int size)
{
	int64_t *in, *out;
	int i, errors = 0;

	in = malloc(RED_COUNT * sizeof(*in));
	out = malloc(RED_COUNT * sizeof(*out));
	if (!in || !out)
		MPI_Abort(MPI_COMM_WORLD, 2);
	for (i = 0; i < RED_COUNT; i++)
		in[i] = (int64_t)(rank + 1) * (i + 3);
	MPI_Allreduce(in, out, RED_COUNT, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
	/* sum over ranks r of (r + 1) * (i + 3) */
	for (i = 0; i < RED_COUNT; i++)
		if (out[i] != (int64_t)size * (size + 1) / 2 * (i + 3))
			errors++;
	if (rank == 0)
		printf("allreduce %d x int64 over %d ranks: %s\n", RED_COUNT,
		       size, errors ? "WRONG" : "ok");
	free(in);
	free(out);
	return errors;
}

static int bandwidth(int rank, uint8_t *bufs)
{
	MPI_Request req[BW_WINDOW];
	int peer = !rank, r, w, errors = 0;
	double t0, t1;
	char ack = 0;

	MPI_Barrier(MPI_COMM_WORLD);
	t0 = MPI_Wtime();
	for (r = 0; r < BW_ROUNDS; r++) {
		for (w = 0; w < BW_WINDOW; w++) {
			uint8_t *b = bufs + (size_t)w * MAX_MSG;

			if (rank == 0) {
				fill(b, MAX_MSG, (uint32_t)(r * BW_WINDOW + w));
				MPI_Isend(b, MAX_MSG, MPI_BYTE, peer, 3,
					  MPI_COMM_WORLD, &req[w]);
			} else {
				MPI_Irecv(b, MAX_MSG, MPI_BYTE, peer, 3,
					  MPI_COMM_WORLD, &req[w]);
			}
		}
		MPI_Waitall(BW_WINDOW, req, MPI_STATUSES_IGNORE);
		if (rank == 1)
			for (w = 0; w < BW_WINDOW; w++)
				if (check(bufs + (size_t)w * MAX_MSG, MAX_MSG,
					  (uint32_t)(r * BW_WINDOW + w)))
					errors++;
		if (rank == 0)
			MPI_Recv(&ack, 1, MPI_CHAR, peer, 4, MPI_COMM_WORLD,
				 MPI_STATUS_IGNORE);
		else
			MPI_Send(&ack, 1, MPI_CHAR, peer, 4, MPI_COMM_WORLD);
	}
	t1 = MPI_Wtime();
	if (rank == 0)
		printf("bandwidth %d x %d B: %.1f MB/s (the time includes filling the buffers)\n",
		       BW_ROUNDS * BW_WINDOW, MAX_MSG,
		       (double)BW_ROUNDS * BW_WINDOW * MAX_MSG / (t1 - t0) / 1e6);
	return errors;
}

int main(int argc, char **argv)
{
	int rank, size, errors = 0, total = 0;
	size_t len;
	uint8_t *buf;

	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &size);
	if (size != 2) {
		if (rank == 0)
			fprintf(stderr, "mpi_check: needs 2 ranks, has %d\n", size);
		MPI_Finalize();
		return 2;
	}
	buf = malloc((size_t)BW_WINDOW * MAX_MSG);
	if (!buf)
		MPI_Abort(MPI_COMM_WORLD, 2);
	for (len = 8; len <= MAX_MSG; len *= 16)
		errors += pingpong(rank, buf, len, len >= 65536 ? 20 : 200);
	errors += pingpong(rank, buf, MAX_MSG, 20);
	errors += allreduce(rank, size);
	errors += bandwidth(rank, buf);
	MPI_Reduce(&errors, &total, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
	if (rank == 0)
		printf("mpi_check: %s (%d bad messages or values)\n",
		       total ? "FAILED" : "passed", total);
	free(buf);
	MPI_Finalize();
	return total ? 1 : 0;
}
