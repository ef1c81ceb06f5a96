#include "shim.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>
#include <chrono>
#include <sys/mman.h>
#include "simd.h"
namespace {
#include "body.inc"
#ifdef VARIANT
#include VARIANT
#endif
}
using namespace std;
static double now(){ if(getenv("CPUT")){timespec ts; clock_gettime(CLOCK_PROCESS_CPUTIME_ID,&ts); return ts.tv_sec+ts.tv_nsec*1e-9;} return chrono::duration<double>(chrono::steady_clock::now().time_since_epoch()).count();}
float* alloc(size_t n, bool huge){
  size_t bytes=n*4, H=2<<20; bytes=(bytes+H-1)/H*H;
  char* raw=(char*)mmap(nullptr,bytes+H,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
  char* s=(char*)(((uintptr_t)raw+H-1)/H*H);
  if(huge) madvise(s,bytes,MADV_HUGEPAGE); else madvise(s,bytes,MADV_NOHUGEPAGE);
  float* f=(float*)s; for(size_t i=0;i<n;i++) f[i]=(float)((i*2654435761u)%1000)/1000.f-0.5f; return f;
}
// mirrors paged_decode_impl<float> (fp32)
template<class F>
void run(F attend_item, const float* qp, const float* kp, const float* vp, const int32_t* tp, int64_t tstride, const int32_t* lp, int64_t B, int64_t H, int64_t D, int64_t KVH, int64_t bs, float scale, float* op){
  const Shape sh{bs,KVH,H/KVH,D,KVH*D};
  int64_t part_len=kMaxPartition; const int64_t want_items=4*at::get_num_threads();
  auto count_items=[&](int64_t len){int64_t n=0; for(int64_t b=0;b<B;++b) n+=std::max<int64_t>(1,(lp[b]+len-1)/len); return n;};
  while(part_len>kMinPartition && count_items(part_len)<want_items) part_len/=2;
  std::vector<int64_t> first_item(B+1,0);
  for(int64_t b=0;b<B;++b) first_item[b+1]=first_item[b]+std::max<int64_t>(1,(lp[b]+part_len-1)/part_len);
  const int64_t items=first_item[B];
  std::vector<float> qs(B*H*D), part_m(items*H), part_l(items*H), part_acc(items*H*D);
  for(int64_t i=0;i<B*H*D;i++) qs[i]=qp[i]*scale;
  const int64_t nthreads=std::max<int64_t>(1,std::min<int64_t>(at::get_num_threads(),items));
  std::vector<int64_t> split(nthreads+1,items);
  { int64_t total=0; for(int64_t b=0;b<B;++b) total+=std::max<int64_t>(1,lp[b]); split[0]=0; int64_t acc=0,t=1,it=0;
    for(int64_t b=0;b<B&&t<nthreads;++b) for(int64_t p=first_item[b];p<first_item[b+1]&&t<nthreads;++p,++it){
      const int64_t t0=(p-first_item[b])*part_len; acc+=std::max<int64_t>(1,std::min<int64_t>(lp[b],t0+part_len)-t0);
      while(t<nthreads&&acc*nthreads>=total*t) split[t++]=it+1; } }
#pragma omp parallel num_threads(nthreads)
  { int th=omp_get_thread_num();
    std::vector<float> scores(H*(std::max(part_len,kChunk)+1));
    for(int64_t it=split[th];it<split[th+1];++it){
      const int64_t b=std::upper_bound(first_item.begin(),first_item.end(),it)-first_item.begin()-1;
      const int64_t t0=(it-first_item[b])*part_len, t1=std::min<int64_t>(lp[b],t0+part_len);
      const Item item{&qs[b*H*D],tp+b*tstride,t0,t1,&part_m[it*H],&part_l[it*H],&part_acc[it*H*D],qp,0,scale};
      attend_item(item,kp,vp,sh,scores.data());
    } }
  for(int64_t bh=0;bh<B*H;++bh){ const int64_t b=bh/H,h=bh%H; float* o=op+bh*D; float mx=-INFINITY;
    for(int64_t it=first_item[b];it<first_item[b+1];++it) mx=std::max(mx,part_m[it*H+h]);
    float den=0; std::fill(o,o+D,0.f);
    for(int64_t it=first_item[b];it<first_item[b+1];++it){ float w=std::exp(part_m[it*H+h]-mx); den+=w*part_l[it*H+h]; const float* a=&part_acc[(it*H+h)*D]; for(int c=0;c<D;c++) o[c]+=w*a[c]; }
    for(int c=0;c<D;c++) o[c]/=den; }
}
// pure read of the same rows: floor for the access pattern
void read_item(const Item& it, const float* k, const float* v, const Shape& sh, float* scores){
  __m256 a=_mm256_setzero_ps(), b=_mm256_setzero_ps();
  for_each_run(it.table, sh.block_size, it.t0, it.t1, [&](int64_t row, int64_t count){
    const float* kr=k+row*sh.row_stride; const float* vr=v+row*sh.row_stride; int64_t n=count*sh.row_stride;
    for(int64_t i=0;i<n;i+=16){ a=_mm256_add_ps(a,_mm256_add_ps(_mm256_loadu_ps(kr+i),_mm256_loadu_ps(kr+i+8))); b=_mm256_add_ps(b,_mm256_add_ps(_mm256_loadu_ps(vr+i),_mm256_loadu_ps(vr+i+8)));}
  });
  it.m[0]=hsum(_mm256_add_ps(a,b)); for(int i=1;i<9;i++) it.m[i]=0; it.l[0]=1;
}
int main(int argc,char**argv){
  int B=atoi(argv[1]), L=atoi(argv[2]); bool huge=atoi(argv[3]); int reps=argc>4?atoi(argv[4]):20;
  const int H=9,KVH=3,D=64,bs=16; const int LAY=getenv("LAYERS")?atoi(getenv("LAYERS")):30; int NB=atoi(getenv("NB")?getenv("NB"):"1024");
  size_t per=(size_t)NB*bs*KVH*D;
  std::vector<float*> K(LAY),V(LAY); for(int l=0;l<LAY;l++){K[l]=alloc(per,huge);V[l]=alloc(per,huge);}
  std::mt19937 rng(1); std::vector<int> perm(NB); for(int i=0;i<NB;i++)perm[i]=i; std::shuffle(perm.begin(),perm.end(),rng);
  int nbl=(L+bs-1)/bs; std::vector<int32_t> table(B*nbl), lens(B,L); for(int i=0;i<B*nbl;i++) table[i]=perm[i];
  std::vector<float> q(B*H*D); for(auto&x:q) x=(rng()%1000)/1000.f-0.5f; std::vector<float> out(B*H*D), ref(B*H*D);
  float scale=0.125f;
  auto fn0=attend_item_fixed<float,3,32>;
  std::vector<std::pair<const char*, void(*)(const Item&,const float*,const float*,const Shape&,float*)>> fns={{"cur",fn0},{"read",read_item}};
#ifdef VARIANT
  fns.push_back({"new",NEWFN});
#endif
  run(fn0,q.data(),K[0],V[0],table.data(),nbl,lens.data(),B,H,D,KVH,bs,scale,ref.data());
#ifdef VARIANT
  run(NEWFN,q.data(),K[0],V[0],table.data(),nbl,lens.data(),B,H,D,KVH,bs,scale,out.data());
  double md=0; for(size_t i=0;i<out.size();i++) md=std::max(md,(double)fabs(out[i]-ref[i])); printf("maxdiff %.3g\n",md);
#endif
  double bytes=(double)B*L*KVH*D*2*4;
  for(auto&f:fns){ if(getenv("FN") && strcmp(getenv("FN"),f.first)) continue; std::vector<double> ts;
    for(int r=0;r<reps;r++){ double t=now(); for(int l=0;l<LAY;l++) run(f.second,q.data(),K[l],V[l],table.data(),nbl,lens.data(),B,H,D,KVH,bs,scale,out.data()); ts.push_back((now()-t)/LAY);}
    std::sort(ts.begin(),ts.end()); double m=ts[ts.size()/2];
    printf("%-5s B=%d L=%d huge=%d thr=%d: %.1f us/layer  %.2f GB/s\n",f.first,B,L,huge,omp_get_max_threads(),m*1e6,bytes/m/1e9);}
}
